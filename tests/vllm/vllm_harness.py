"""Test fixtures: real vLLM CPU engines on tiny local models, and transformers references.

Everything here works offline: models are built from configs (no hub), tokenizers are a
local WordLevel vocabulary ``t0 … t{V-1}``. vLLM is imported only inside functions, so this
module imports without it.

Typical use::

    model = tiny_model(tiny_llama_config())        # seeded random bf16 weights
    model_dir = write_model_dir(tmp / "llama", model)   # safetensors + config + tokenizer
    with VLLMServer(model_dir, tp=2, load_format="auto", dtype="float32") as server:
        tokens, logprobs = server.completions(prompt, max_tokens=8)
    assert_greedy_matches(model.float(), prompt, tokens, logprobs)  # atol 1e-4 in fp32

Contracts shared by the generation helpers: a prompt is a list of token ids; greedy results
are ``(token_ids, logprobs)``, two lists of equal length where ``logprobs[i]`` is the
natural-log probability of ``token_ids[i]`` under the full (unmodified) distribution.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
)

from reshard_core.testing.world import free_port

if TYPE_CHECKING:
    from vllm import LLM

Greedy = tuple[list[int], list[float]]

#: Engine settings shared by the server and the offline engine.
MAX_MODEL_LEN = 128
#: On CPU this is the fraction of host memory vLLM may reserve (vLLM's default 0.9 fails).
CPU_MEMORY_FRACTION = 0.15
#: KV cache per worker, explicit: vLLM would otherwise size it from free host memory
#: (1.4 GiB here; server RSS 3.3 GiB instead of 1.9 GiB at TP1). 64 MiB is 131k tokens.
KV_CACHE_BYTES = 64 << 20
#: Weight init std of ``tiny_model`` (transformers' default). Larger stds make vLLM's CPU
#: attention kernel drift from transformers (fp32: 1e-5 at 0.02, 2e-4 at 0.05, 2e-2 at 0.2)
#: without making greedy ties rarer relative to that noise.
DEFAULT_INIT_STD = 0.02
#: ``check_greedy`` tolerances (nats) per reference dtype, calibrated at DEFAULT_INIT_STD on
#: vLLM 0.32 CPU (measured max |dlogprob|: fp32 Llama 9e-6, fp32 Qwen3-MoE 2e-4 from the CPU
#: MoE kernel; bf16 4e-3 / 1.6e-2). A wrong TP shard or expert moves logprobs by >= 4e-2.
TOLERANCES: dict[torch.dtype, float] = {torch.float32: 1e-3, torch.bfloat16: 0.05, torch.float16: 0.05}


# --------------------------------------------------------------------------- models


def _tiny_common(vocab_size: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # TP2 splits kv heads, one per rank
        head_dim=32,
        max_position_embeddings=2 * MAX_MODEL_LEN,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    )


def tiny_llama_config(**overrides: Any) -> LlamaConfig:
    """A 2-layer Llama (hidden 128, 4 heads, 2 kv heads, vocab 512), bf16, untied head.

    ``overrides`` replace any config field. Shapes divide evenly for TP 1 and 2.
    """
    kwargs = _tiny_common(512) | dict(intermediate_size=256, architectures=["LlamaForCausalLM"])
    return LlamaConfig(**(kwargs | overrides))


def tiny_qwen3_moe_config(**overrides: Any) -> Qwen3MoeConfig:
    """A 2-layer Qwen3-MoE (4 experts, top-2, expert width 64, vocab 512), bf16.

    Every layer is sparse. vLLM shards each expert over TP (no expert parallelism), so
    ``moe_intermediate_size`` must stay divisible by TP.
    """
    kwargs = _tiny_common(512) | dict(
        intermediate_size=256,
        moe_intermediate_size=64,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        architectures=["Qwen3MoeForCausalLM"],  # without it vLLM picks a pooling model
    )
    return Qwen3MoeConfig(**(kwargs | overrides))


def tiny_model(
    config: PretrainedConfig, *, seed: int = 0, init_std: float = DEFAULT_INIT_STD
) -> PreTrainedModel:
    """A causal LM for ``config`` with seeded random weights, in the config's dtype, eval mode.

    Linear and embedding weights are drawn from N(0, init_std) (transformers' own init with
    ``initializer_range=init_std``); norms are 1. ``config`` is not modified. Pass
    ``dtype="float32"`` in the config (or ``.float()`` the model) for a float32 reference.
    """
    config = copy.deepcopy(config)
    config.initializer_range = init_std
    dtype = getattr(config, "dtype", None) or torch.bfloat16
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def write_tokenizer(path: str | os.PathLike[str], vocab_size: int) -> None:
    """Save a local WordLevel tokenizer ``t0 … t{vocab_size-1}`` (whitespace split) to ``path``.

    Id ``i`` is the word ``t{i}``; unknown words map to ``t0``; ``t1``/``t2`` are bos/eos,
    matching the tiny configs. No extra tokens, so the tokenizer never exceeds the vocab.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="t0",
        bos_token="t1",
        eos_token="t2",
        model_max_length=MAX_MODEL_LEN,
    )
    fast.save_pretrained(str(path))


def write_model_dir(
    path: str | os.PathLike[str],
    config: PretrainedConfig | PreTrainedModel,
    *,
    tokenizer: bool = True,
) -> Path:
    """Write a model directory that vLLM can serve offline; return its path.

    ``config`` may be a config (writes config.json only: serve it with ``load_format="dummy"``)
    or a model (``save_pretrained`` as safetensors: serve it with ``load_format="auto"``).
    Always writes generation_config.json (bos/eos only, so no sampling defaults leak in);
    with ``tokenizer`` also the local WordLevel tokenizer. Creates ``path`` if needed.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if isinstance(config, PreTrainedModel):
        config.save_pretrained(str(path), safe_serialization=True)
        config = config.config
    else:
        config.save_pretrained(str(path))
    generation = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id)
    generation.save_pretrained(str(path))
    if tokenizer:
        write_tokenizer(path, config.vocab_size)
    return path


# --------------------------------------------------------------------------- environment


def _cpu_bind(tp: int) -> str:
    """OMP core lists for ``tp`` CPU workers, ``|``-separated, one core group per rank.

    One core is left for the API server / engine-core processes when there are more cores
    than ranks; with fewer cores than ranks, ranks share cores round-robin.
    """
    cpus = sorted(os.sched_getaffinity(0))
    spare = 1 if len(cpus) > tp else 0
    per_rank = max(1, (len(cpus) - spare) // tp)
    groups = [
        cpus[r * per_rank : (r + 1) * per_rank] if (r + 1) * per_rank <= len(cpus) else [cpus[r % len(cpus)]]
        for r in range(tp)
    ]
    return "|".join(",".join(map(str, g)) for g in groups)


def engine_env(tp: int) -> dict[str, str]:
    """Environment variables a vLLM CPU engine with ``tp`` ranks needs on this machine.

    Explicit OMP thread binding (vLLM's "auto" needs one NUMA node per rank), the dev-mode
    RL endpoints, no hub / usage-stats network traffic. Merge over ``os.environ``.
    """
    return {
        "VLLM_CPU_OMP_THREADS_BIND": _cpu_bind(tp),
        "VLLM_SERVER_DEV_MODE": "1",  # /init_weight_transfer_engine, /update_weights, ...
        "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # collective_rpc with callables
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_DO_NOT_TRACK": "1",
        "DO_NOT_TRACK": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(ppid, pgid, start time) of a live (non-zombie) process, or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else (int(fields[1]), int(fields[2]), int(fields[19]))


def process_tree(root: int) -> list[int]:
    """Live pids of ``root`` and all its descendants (root first)."""
    stats = {int(p): s for p in os.listdir("/proc") if p.isdigit() and (s := _proc_stat(int(p)))}
    tree, frontier = [], [root] if root in stats else []
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier += [c for c, (ppid, _, _) in stats.items() if ppid == pid]
    return tree


def process_group(pgid: int) -> list[int]:
    """Live pids whose process group is ``pgid``."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and (s := _proc_stat(int(p))) and s[1] == pgid]


def rss_bytes(pids: Iterable[int], *, proportional: bool = False) -> int:
    """Total resident memory of ``pids``: RSS (shared pages counted in every process that
    maps them), or with ``proportional`` PSS (shared pages split among them)."""
    key = "Pss:" if proportional else "Rss:"
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))
        except (OSError, StopIteration):
            pass
    return total


def _tail(path: Path, n: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError as e:
        return f"<no log: {e}>"


#: urllib opener that ignores *_proxy variables: every server here is local.
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class VLLMServerError(RuntimeError):
    """The server failed to start, died, or answered a request with an error."""


class VLLMServer:
    """An OpenAI-compatible vLLM server on CPU, in its own process group (context manager).

    ``start()`` launches ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with
    ``engine_env(tp)`` over ``os.environ`` (then ``env``), bf16 by default, eager mode,
    ``max_model_len`` 128, a 64 MiB KV cache, and blocks until ``/health`` answers 200 or raises
    ``VLLMServerError`` with the log tail (after ``startup_timeout`` s, or at once if the
    process exits). ``stop()`` SIGTERMs then SIGKILLs the whole process group and every
    descendant seen, and is idempotent. ``weight_transfer_backend`` (a name, or a full
    ``--weight-transfer-config`` dict) is passed through unchecked; ``extra_args`` are
    appended last, so they override the defaults.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        tp: int = 1,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        weight_transfer_backend: str | Mapping[str, Any] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        startup_timeout: float = 300,
        *,
        load_format: str = "dummy",
        dtype: str = "bfloat16",
        env: Mapping[str, str] | None = None,
    ) -> None:
        if not Path(model_dir, "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {model_dir} (see write_model_dir)")
        self.model_dir = str(model_dir)
        self.tp = tp
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.weight_transfer_backend = weight_transfer_backend
        if log_path is None:
            log_path = Path(tempfile.mkdtemp(prefix="vllm-server-")) / "server.log"
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.load_format = load_format
        self.dtype = dtype
        self.env = dict(env or {})
        self.startup_seconds: float | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, int] = {}  # pid -> start time of every process of the server seen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server command line."""
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--tensor-parallel-size", str(self.tp),
            "--load-format", self.load_format,
            "--dtype", self.dtype,
            "--enforce-eager",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--gpu-memory-utilization", str(CPU_MEMORY_FRACTION),
            "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
            "--disable-log-stats",
        ]  # fmt: skip
        if self.weight_transfer_backend is not None:
            wt = self.weight_transfer_backend
            wt = {"backend": wt} if isinstance(wt, str) else dict(wt)
            cmd += ["--weight-transfer-config", json.dumps(wt)]
        return cmd + self.extra_args

    def start(self) -> VLLMServer:
        """Launch and wait until healthy; sets ``startup_seconds``. Returns self."""
        if self.proc is not None:
            raise VLLMServerError("server already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **engine_env(self.tp), **self.env}
        t0 = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.command(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        try:
            self._wait_healthy(t0 + self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def _wait_healthy(self, deadline: float) -> None:
        assert self.proc is not None
        while True:
            self._remember()
            if self.proc.poll() is not None:
                raise VLLMServerError(
                    f"vLLM server exited with code {self.proc.returncode} during start-up; "
                    f"log {self.log_path} ends:\n{_tail(self.log_path)}"
                )
            try:
                with _LOCAL.open(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise VLLMServerError(
                    f"vLLM server not healthy after {self.startup_timeout:.0f} s; "
                    f"log {self.log_path} ends:\n{_tail(self.log_path)}"
                )
            time.sleep(0.5)

    def _remember(self) -> None:
        for pid in self.pids():
            if stat := _proc_stat(pid):
                self._seen[pid] = stat[2]

    def pids(self) -> list[int]:
        """Live pids of the server and its engine-core / worker descendants."""
        return process_tree(self.proc.pid) if self.proc else []

    def rss_bytes(self, *, proportional: bool = False) -> int:
        """Resident memory of the server's process tree (see the module-level ``rss_bytes``)."""
        return rss_bytes(self.pids(), proportional=proportional)

    def post(self, route: str, payload: Mapping[str, Any] | None = None, timeout: float = 120) -> Any:
        """``post_json`` to this server."""
        return post_json(self.url + route, payload, timeout)

    def completions(self, prompt_ids: list[int], max_tokens: int, logprobs: int = 1) -> Greedy:
        """Greedy (temperature 0, ignore_eos) completion of one token-id prompt.

        Returns ``(token_ids, logprobs)`` of exactly ``max_tokens`` generated tokens;
        ``logprobs`` are those of the chosen tokens. ``logprobs`` (>= 1) is the top-k asked for.
        """
        return completions(self.url, self.model_dir, prompt_ids, max_tokens, logprobs)

    def stop(self, timeout: float = 20) -> None:
        """SIGTERM, then after ``timeout`` s SIGKILL, the process group and every descendant
        seen (pids checked against their start time); return once none is alive.

        Idempotent. Raises ``VLLMServerError`` if a process survives SIGKILL.
        """
        if self.proc is None:
            return
        self._remember()
        pgid = self.proc.pid  # start_new_session: the server leads its own group
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            live = self._live(pgid)
            if not live:
                break
            for pid in live:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self._live(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
        left = self._live(pgid)
        if self.proc.poll() is None and not left:
            self.proc.wait(5)
        self.proc = None
        if left:
            raise VLLMServerError(f"vLLM server processes still alive after SIGKILL: {left}")

    def _live(self, pgid: int) -> list[int]:
        """Live processes of this server: its group, and descendants seen that left it."""
        seen = [p for p, start in self._seen.items() if (st := _proc_stat(p)) and st[2] == start]
        return sorted(set(process_group(pgid)) | set(seen))

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def post_json(url: str, payload: Mapping[str, Any] | None = None, timeout: float = 120) -> Any:
    """POST ``payload`` as JSON to ``url``; return the decoded JSON answer (None if empty).

    Raises ``VLLMServerError`` with the status and body on an HTTP error.
    """
    req = urllib.request.Request(
        url, data=json.dumps(payload or {}).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with _LOCAL.open(req, timeout=timeout) as r:
            body = r.read()
    except urllib.error.HTTPError as e:
        raise VLLMServerError(f"POST {url} -> {e.code}: {e.read().decode(errors='replace')}") from None
    return json.loads(body) if body.strip() else None


def completions(url: str, model: str, prompt_ids: list[int], max_tokens: int, logprobs: int = 1) -> Greedy:
    """``VLLMServer.completions`` for a server known only by ``url`` and served ``model`` name
    (from another process, e.g. a trainer job). Raises ``VLLMServerError`` on an HTTP error."""
    answer = post_json(url + "/v1/completions", {
        "model": model, "prompt": list(prompt_ids), "max_tokens": max_tokens, "temperature": 0.0,
        "ignore_eos": True, "logprobs": logprobs, "return_token_ids": True,
    })  # fmt: skip
    choice = answer["choices"][0]
    return list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]


# --------------------------------------------------------------------------- offline engine


def offline_llm(
    model_dir: str | os.PathLike[str],
    tp: int = 1,
    *,
    load_format: str = "dummy",
    dtype: str = "bfloat16",
    **kwargs: Any,
) -> LLM:
    """A ``vllm.LLM`` on CPU with this module's settings; ``kwargs`` pass through (e.g.
    ``weight_transfer_config={"backend": "reshard"}``) and override the defaults.

    Side effect: updates ``os.environ`` with ``engine_env(tp)`` (the engine-core process
    inherits it). The caller must be importable under spawn (``if __name__ == "__main__"``
    in scripts) and should release it with ``shutdown_llm``.
    """
    from vllm import LLM

    os.environ.update(engine_env(tp))
    settings: dict[str, Any] = dict(
        model=str(model_dir),
        tensor_parallel_size=tp,
        load_format=load_format,
        dtype=dtype,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        gpu_memory_utilization=CPU_MEMORY_FRACTION,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        disable_log_stats=True,
    )
    return LLM(**(settings | kwargs))


def shutdown_llm(llm: LLM, timeout: float = 20) -> None:
    """Stop the engine-core and worker processes of ``llm`` (best effort, idempotent)."""
    llm.llm_engine.engine_core.shutdown(timeout=timeout)


def llm_greedy(llm: LLM, prompt_ids: list[int], max_tokens: int, logprobs: int = 1) -> Greedy:
    """Greedy generation with an offline ``LLM``; same contract as ``VLLMServer.completions``."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False, logprobs=logprobs
    )
    [out] = llm.generate([TokensPrompt(prompt_token_ids=list(prompt_ids))], params, use_tqdm=False)
    completion = out.outputs[0]
    tokens = list(completion.token_ids)
    return tokens, [float(step[t].logprob) for t, step in zip(tokens, completion.logprobs, strict=True)]


# --------------------------------------------------------------------------- reference


@torch.no_grad()
def _next_token_logprobs(model: PreTrainedModel, ids: list[int], last: int) -> torch.Tensor:
    """float32 log-softmax of the model's logits at the final ``last`` positions of ``ids``."""
    device = next(model.parameters()).device
    logits = model(torch.tensor([ids], device=device)).logits[0, -last:]
    return logits.float().log_softmax(-1).cpu()


def _hf_greedy_steps(
    model: PreTrainedModel, prompt_ids: list[int], max_tokens: int
) -> tuple[list[int], list[float], list[float]]:
    """Greedy tokens, their logprobs, and the top-1 minus top-2 logprob margin at each step."""
    ids, tokens, logprobs, margins = list(prompt_ids), [], [], []
    for _ in range(max_tokens):
        lp = _next_token_logprobs(model, ids, 1)[0]
        top = lp.topk(2).values
        tokens.append(int(lp.argmax()))
        logprobs.append(float(top[0]))
        margins.append(float(top[0] - top[1]))
        ids.append(tokens[-1])
    return tokens, logprobs, margins


def hf_greedy(model: PreTrainedModel, prompt_ids: list[int], max_tokens: int) -> Greedy:
    """Greedy decoding with a transformers causal LM, in the model's dtype (no sampling,
    no EOS stop, no cache: each step re-runs the whole sequence).

    Returns ``(token_ids, logprobs)`` like vLLM's: log-softmax (in float32) of the logits.
    Ties go to the lowest token id.
    """
    tokens, logprobs, _ = _hf_greedy_steps(model, prompt_ids, max_tokens)
    return tokens, logprobs


def stable_prompts(
    model: PreTrainedModel,
    count: int,
    *,
    prompt_len: int = 8,
    max_tokens: int = 8,
    min_margin: float,
    seed: int = 0,
    max_tries: int = 1000,
) -> list[list[int]]:
    """``count`` seeded random prompts (ids 3 … vocab-1) whose greedy continuation under
    ``model`` has a top-1 margin of at least ``min_margin`` nats at each of ``max_tokens``
    steps, so an engine within that much noise must produce exactly the same tokens.

    Raises ``ValueError`` if ``max_tries`` candidates do not yield ``count`` prompts.
    """
    gen = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    found: list[list[int]] = []
    for _ in range(max_tries):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        if min(_hf_greedy_steps(model, prompt, max_tokens)[2]) >= min_margin:
            found.append(prompt)
            if len(found) == count:
                return found
    raise ValueError(f"only {len(found)} of {count} prompts with margin >= {min_margin} in {max_tries} tries")


@dataclass
class GreedyCheck:
    """How a generation compares with the reference model, teacher-forced on its tokens.

    At each step ``i`` the reference scores the engine's prefix: ``ref_logprobs[i]`` is its
    logprob of the engine's token, ``ref_best[i]`` its top token, ``ref_gaps[i]`` how far
    the engine's token is below the reference's top logprob (0 when they agree), and
    ``ref_margins[i]`` the reference's top-1 minus top-2 logprob.
    """

    token_ids: list[int]
    logprobs: list[float]
    ref_logprobs: list[float]
    ref_best: list[int]
    ref_gaps: list[float]
    ref_margins: list[float]
    logprob_atol: float
    tie_atol: float
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors

    @property
    def max_logprob_diff(self) -> float:
        return max((abs(a - b) for a, b in zip(self.logprobs, self.ref_logprobs, strict=True)), default=0.0)

    @property
    def argmax_mismatches(self) -> list[int]:
        """Steps where the engine did not pick the reference's top token."""
        return [i for i, (t, b) in enumerate(zip(self.token_ids, self.ref_best, strict=True)) if t != b]

    def __str__(self) -> str:
        head = (
            f"GreedyCheck({'ok' if self.ok else 'FAILED'}: {len(self.token_ids)} tokens, "
            f"max |dlogprob|={self.max_logprob_diff:.3g} (atol {self.logprob_atol}), "
            f"argmax mismatches at {self.argmax_mismatches}, "
            f"min ref margin={min(self.ref_margins, default=float('nan')):.3g})"
        )
        return "\n  ".join([head, *self.errors])


def check_greedy(
    model: PreTrainedModel,
    prompt_ids: list[int],
    token_ids: list[int],
    logprobs: list[float],
    *,
    logprob_atol: float | None = None,
    tie_atol: float | None = None,
) -> GreedyCheck:
    """Compare an engine's greedy output with ``model`` without cascading divergences.

    The reference scores ``prompt_ids + token_ids`` in one forward pass (teacher forcing), so
    a near-tie resolved differently at step ``i`` does not make steps after ``i`` fail.
    A step fails if the engine's token is more than ``tie_atol`` below the reference's top
    logprob (a wrong greedy pick, not a near-tie), or if the engine's logprob differs from
    the reference's for the same token by more than ``logprob_atol``. Both default to
    ``TOLERANCES[model dtype]``. Never raises on a mismatch; see ``GreedyCheck.errors``.
    """
    default = TOLERANCES[next(model.parameters()).dtype]
    logprob_atol = default if logprob_atol is None else logprob_atol
    tie_atol = default if tie_atol is None else tie_atol
    if len(token_ids) != len(logprobs) or not token_ids:
        raise ValueError(f"need equal, non-zero lengths: {len(token_ids)} tokens, {len(logprobs)} logprobs")
    lp = _next_token_logprobs(model, list(prompt_ids) + list(token_ids[:-1]), len(token_ids))
    top2 = lp.topk(2, dim=-1)
    ref_logprobs = [float(lp[i, t]) for i, t in enumerate(token_ids)]
    check = GreedyCheck(
        token_ids=list(token_ids),
        logprobs=list(logprobs),
        ref_logprobs=ref_logprobs,
        ref_best=top2.indices[:, 0].tolist(),
        ref_gaps=[float(top2.values[i, 0]) - r for i, r in enumerate(ref_logprobs)],
        ref_margins=(top2.values[:, 0] - top2.values[:, 1]).tolist(),
        logprob_atol=logprob_atol,
        tie_atol=tie_atol,
    )
    steps = zip(token_ids, logprobs, ref_logprobs, check.ref_gaps, strict=True)
    for i, (t, got, ref, gap) in enumerate(steps):
        if gap > tie_atol:
            check.errors.append(
                f"step {i}: engine picked {t} (ref logprob {ref:.4f}), reference top is "
                f"{check.ref_best[i]} ({ref + gap:.4f}), gap {gap:.4f} > tie_atol {tie_atol}"
            )
        if abs(got - ref) > logprob_atol:
            check.errors.append(
                f"step {i}: token {t} logprob {got:.4f} vs reference {ref:.4f}, "
                f"|diff| {abs(got - ref):.4f} > logprob_atol {logprob_atol}"
            )
    return check


def assert_greedy_matches(
    model: PreTrainedModel,
    prompt_ids: list[int],
    token_ids: list[int],
    logprobs: list[float],
    **tolerances: float,
) -> GreedyCheck:
    """``check_greedy`` that raises ``AssertionError`` (with the full report) on failure."""
    check = check_greedy(model, prompt_ids, token_ids, logprobs, **tolerances)
    if not check.ok:
        raise AssertionError(str(check))
    return check
