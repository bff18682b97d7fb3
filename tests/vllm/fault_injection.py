"""A vLLM worker extension for the fault tests: makes one call of the reshard engine fail on chosen
workers only, from outside the server.

The TP2 test server runs with ``--worker-extension-cls fault_injection.FaultInjection`` (this folder
on its ``PYTHONPATH``). ``POST /collective_rpc`` with ``{"method": "reshard_arm_fault", "args":
[call, ranks]}`` arms the next ``call`` ("init", "start", "update" or "finish") to fail once on the
workers whose rank is in ``ranks`` (comma-separated), with ``injected fault: <call> on worker <rank>``;
"rollback" fails once a receive has closed its reload (as vLLM's own finalize once did on MLA layers).
Each fault sits where a real one would: inside the engine's own step, so the code around it (the
update's agreement, ``rpc_guard``) runs as it would for a real failure.
"""

from __future__ import annotations

from typing import Any

CALLS = ("init", "start", "update", "finish", "rollback")


class FaultInjection:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    def reshard_arm_fault(self, call: str, ranks: str) -> str:
        from vllm.distributed.parallel_state import get_world_group

        rank = get_world_group().rank_in_group
        if call not in CALLS:
            raise ValueError(f"unknown call {call!r}; one of {CALLS}")
        if str(rank) not in ranks.split(","):
            return "unarmed"
        engine = self.weight_transfer_engine
        text = f"injected fault: {call} on worker {rank}"
        if call == "init":  # before the worker joins the trainer's group
            _fail_once(engine, "init_transfer_engine", text)
        elif call == "start":
            _fail_once(engine, "start_weight_update", text)
        elif call == "update":  # inside the receive, before this worker's refit: its verdict says so
            import reshard_vllm.engine as module

            _fail_once(module, "declare_vllm", text)
        elif call == "rollback":  # the receive's reload closed, then an error: the verdict carries it
            from reshard_vllm.reload import LayerwiseUpdate

            rollback = LayerwiseUpdate.rollback

            def failing_rollback(update: Any) -> None:
                LayerwiseUpdate.rollback = rollback
                rollback(update)
                raise RuntimeError(text)

            LayerwiseUpdate.rollback = failing_rollback
        else:  # inside finish, while the worker opens the staged update, before a live weight changes
            finish = engine.finish_weight_update

            def failing_finish() -> None:
                engine.finish_weight_update = finish
                _fail_once(engine, "_update", text)
                try:
                    finish()
                finally:
                    engine.__dict__.pop("_update", None)

            engine.finish_weight_update = failing_finish
        return "armed"


def _fail_once(owner: Any, name: str, text: str) -> None:
    original = getattr(owner, name)

    def fail(*args: Any, **kwargs: Any) -> Any:
        setattr(owner, name, original)
        raise RuntimeError(text)

    setattr(owner, name, fail)
