"""One rank of the 3-rank worlds of ``test_survivors_exit_cleanly``, as a process of its own (the
test reads its exit status): ``python exiting_rank.py RANK VICTIM HOW PORT [LATE]``.

After one good refit, the victim stops or dies where its transport starts; the others print one
``RESULT <rank> <outcome>`` line after the failed refit and end their script normally, as a training
script that caught the error would. ``LATE``: seconds rank 2 takes before that refit (a slow rank, the
last to learn what failed).
"""

from __future__ import annotations

import datetime
import faulthandler
import sys
import time

import torch.distributed as dist
from three_ranks import models
from victims import stop_or_kill_at_transport_start, timed

import reshard_core


def main(rank: int, victim: int, how: str, port: int, late: float) -> None:
    faulthandler.enable(all_threads=True)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    src, dst = models(rank)
    reshard_core.refit(src, dst, timeout=3.0, verify=True)
    if rank == victim:
        stop_or_kill_at_transport_start(how)
    if rank == 2:
        time.sleep(late)
    _, text = timed(lambda: reshard_core.refit(src, dst, timeout=3.0, verify=True))
    print(f"RESULT {rank} {text}", flush=True)
    dist.destroy_process_group()  # as a script's ``finally`` does (and run_world's ranks)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
         float(sys.argv[5]) if len(sys.argv) > 5 else 0.0)  # fmt: skip
