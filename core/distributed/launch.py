"""Tensor-parallel ranks: starting them, rank 0's model facade, and the other ranks' loop.

Rank 0 is the caller's process: it drives the model API (``logits``, ``generate``, the Generator, the
server) through :class:`TensorParallelModel`, which sends each step's inputs to the other ranks before
running its own part. The other ranks are worker processes trellm starts itself (``python -m
trellm.distributed.worker``; rendezvous through a TCP store on loopback whose port the OS picks), or the
other processes of a ``torchrun`` launch (their ``trellm.load`` serves rank 0 until it closes, then
exits the process). A worker that dies or stops answering ends the model with a
:class:`TensorParallelError` naming the rank and why, within the step timeout; workers exit when rank 0
closes, errs or dies.
"""
from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import Any

import attrs
import torch
import torch.distributed as dist

from ..batch import ForwardBatch
from ..errors import TrellmError
from .comm import Comm

DEFAULT_STEP_TIMEOUT = 120.0  # seconds any collective of a step may take before the model is ended
LOAD_TIMEOUT = 3600.0  # seconds a worker may take to start and load its shard
_KEY = "trellm/tp"


class TensorParallelError(TrellmError):
    """A tensor-parallel rank died, stopped answering, or could not start; the model is closed."""


@attrs.frozen
class RankSpec:
    """What every rank needs to join the group and load its shard (JSON on a worker's command line)."""

    model_dir: str
    world: int
    device: str  # "cpu" or "cuda:<rank 0's index>"
    dtype: str
    step_timeout: float
    host: str = "127.0.0.1"
    port: int = 0

    def rank_device(self, rank: int) -> torch.device:
        base = torch.device(self.device)
        if base.type == "cuda":
            return torch.device("cuda", (base.index or 0) + rank)
        return base



# ---- messages from rank 0 -------------------------------------------------------------------------


@attrs.frozen
class Step:
    """One message: ``kind`` ("forward", "cache", "close"), its payload, and caches rank 0 no longer holds."""

    kind: str
    payload: Any = None
    dropped: tuple[int, ...] = ()


def _to_cpu(value: Any) -> Any:
    return value.to("cpu", copy=True) if isinstance(value, torch.Tensor) else value


def pack_batch(batch: ForwardBatch, cache_id: int | None) -> dict:
    """A batch as plain fields (compact CPU tensors) plus the id of the cache it runs on."""
    fields = {f.name: _to_cpu(getattr(batch, f.name)) for f in attrs.fields(ForwardBatch) if f.name != "cache"}
    return {"fields": fields, "cache_id": cache_id}


def unpack_batch(packed: dict, caches: dict[int, Any], device: torch.device) -> ForwardBatch:
    fields = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in packed["fields"].items()}
    cache_id = packed["cache_id"]
    return ForwardBatch(**fields, cache=None if cache_id is None else caches[cache_id])


def make_local_cache(model: Any, made_with: dict) -> Any:
    """This rank's part of rank 0's cache (``made_with``: its KVCache.for_model arguments): this rank's own
    KV heads in the same pages, and on a hybrid model its own heads' recurrent state in the same slots."""
    from ..cache import KVCache
    from ..capabilities import is_hybrid

    if "mtp" in made_with:  # an MTP proposer's own cache
        from ..generator.mtp import mtp_cache

        return mtp_cache(model, **made_with["mtp"])
    return model.make_cache(**made_with) if is_hybrid(model) else KVCache.for_model(model, **made_with)


def copy_state_slots(cache: Any, copies: list[tuple[int, int]]) -> None:
    """Rank 0's recurrent-state slot copies since its last step (prefix checkpoints, draft snapshots), in order."""
    from ..cache.recurrent import copy_state_slot

    for src, dst in copies:
        copy_state_slot(cache, src, dst)


# ---- rank 0 -----------------------------------------------------------------------------------------


class WorkerGroup:
    """Rank 0's handle on the other ranks: their processes (None under torchrun), liveness and shutdown."""

    def __init__(self, comm: Comm, store: Any, procs: list[subprocess.Popen] | None, step_timeout: float):
        self.comm, self.store, self.procs, self.step_timeout = comm, store, procs, step_timeout
        self.closed = False

    def check(self) -> None:
        """Raise TensorParallelError when a worker has exited (and end the rest)."""
        if self.closed:
            raise TensorParallelError("this tensor-parallel model is closed")
        dead = self._dead()
        if dead:
            self.fail(dead)

    def _dead(self) -> str:
        """Why the workers that exited did; a worker killed by a signal first (the others then lose their peer)."""
        dead = [(proc.poll(), rank, proc) for rank, proc in enumerate(self.procs or [], start=1) if proc.poll() is not None]
        if not dead:
            return ""
        code, rank, proc = min(dead, key=lambda d: (d[0] >= 0, d[1]))
        return describe_exit(rank, proc.pid, code, read_error(self.store, rank))

    def fail(self, reason: str, cause: BaseException | None = None) -> None:
        """End every rank and raise TensorParallelError with ``reason`` (or what the workers say)."""
        time.sleep(0.2)  # a worker that crashed: let its exit status land
        reason = self._dead() or reason
        self.shutdown(graceful=False)
        raise TensorParallelError(f"tensor parallel over {self.comm.world} ranks ended: {reason}") from cause

    def shutdown(self, graceful: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        if graceful and not self._dead():
            try:
                self.comm.send(Step("close"))
            except Exception:  # noqa: BLE001 - a worker gone already: kill below
                graceful = False
        for proc in self.procs or []:
            try:
                proc.wait(timeout=10 if graceful else 0.5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.comm.close()


def describe_exit(rank: int, pid: int, code: int, error: str) -> str:
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
    return f"worker rank {rank} (pid {pid}) {how}" + (f": {error}" if error else "")


def read_error(store: Any, rank: int) -> str:
    """The last line of the exception a worker reported before exiting ('' when none)."""
    key = f"{_KEY}/error/{rank}"
    try:
        if store is None or not store.check([key]):
            return ""
        return store.get(key).decode().strip().splitlines()[-1]
    except Exception:  # noqa: BLE001 - the store itself may be gone with the group
        return ""


class TensorParallelModel:
    """Rank 0's model: the local shard's attributes, and a ``forward`` that first sends the step to every rank.

    A generator or ``LoadedModel`` uses it as the model. A cache made for it (``KVCache.for_model``: by
    ``LoadedModel.new_cache``, the Generator, ``quantized_cache``) is made on every other rank too when a step
    first uses it, with that rank's heads in the same pages. Decode steps run eagerly (``capturable`` is
    False): a captured graph cannot send the step's inputs.
    """

    capturable = False

    def __init__(self, local: Any, comm: Comm, workers: WorkerGroup):
        self.local, self.comm, self.workers = local, comm, workers
        self._cache_ids: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._next_id = itertools.count()
        self._dropped: list[int] = []
        self._hidden: torch.Tensor | None = None  # what hidden_states last returned

    def __getattr__(self, name: str) -> Any:
        if name in ("local", "comm", "workers"):
            raise AttributeError(name)
        return getattr(self.local, name)

    @property
    def world(self) -> int:
        return self.comm.world

    def _send(self, kind: str, payload: Any = None) -> None:
        self.workers.check()
        dropped, self._dropped = tuple(self._dropped), []
        self._guarded(self.comm.send, Step(kind, payload, dropped))

    def _guarded(self, fn, *args):
        try:
            return fn(*args)
        except TensorParallelError:
            raise
        except RuntimeError as e:  # gloo/NCCL: a peer gone or a collective past the step timeout
            self.workers.fail(f"a collective failed or timed out after {self.workers.step_timeout:g} s ({e})", e)

    def _cache_id(self, cache: Any) -> int:
        """The id the other ranks know ``cache`` by; the first time, they make their part of it."""
        cache_id = self._cache_ids.get(cache)
        if cache_id is None:
            made_with = getattr(cache, "made_with", None)
            if made_with is None:
                raise TensorParallelError(
                    "this cache was not made by KVCache.for_model (LoadedModel.new_cache, a Generator, quantized_cache): "
                    "the other ranks cannot make their part of it"
                )
            cache_id = next(self._next_id)
            self._send("cache", (cache_id, made_with))
            self._cache_ids[cache] = cache_id
            cache.state_copies = []
            weakref.finalize(cache, self._dropped.append, cache_id)
        return cache_id

    def _pack(self, batch: ForwardBatch) -> dict:
        """``batch`` for the other ranks (checked: token ids inside the vocabulary), with the cache's pending slot copies."""
        cache_id = None if batch.cache is None else self._cache_id(batch.cache)
        packed = pack_batch(batch, cache_id)
        if batch.cache is not None and batch.cache.state_copies:
            packed["state_copies"], batch.cache.state_copies = batch.cache.state_copies, []
        ids = packed["fields"]["input_ids"]
        vocab = getattr(self.local.config, "vocab_size", None)
        if ids.numel() and vocab and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"token ids must lie in [0, {vocab}), got {int(ids.min())}..{int(ids.max())}")
        return packed

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self._send("forward", self._pack(batch))
        return self._guarded(self.local.forward, batch)

    def time_all_reduce(self, rows: int, reps: int = 20) -> float:
        """Median seconds of one all-reduce of a [rows, hidden] tensor in the model dtype, every rank taking part
        (what each decode step pays twice per layer)."""
        self._send("all_reduce", (rows, reps))
        return self._guarded(time_all_reduce, self.comm, self.local, rows, reps)

    def hidden_states(self, batch: ForwardBatch) -> torch.Tensor:
        """The forward pass up to the last layer's hidden state (whole on every rank; each keeps its own)."""
        self._send("hidden", self._pack(batch))
        self._hidden = self._guarded(self.local.hidden_states, batch)
        return self._hidden

    def logits_from_hidden(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The rest of the forward pass from ``x``: the other ranks use the hidden state they hold when ``x`` is the
        one :meth:`hidden_states` returned (rows are not sent again), else ``x`` as sent."""
        sent = None if x is self._hidden else _to_cpu(x)
        self._hidden = None  # used once: the ranks drop theirs now
        self._send("logits_from_hidden", {"hidden": sent, "logits_indices": _to_cpu(batch.logits_indices)})
        return self._guarded(self.local.logits_from_hidden, x, batch)

    def mtp_rows(self, batch: ForwardBatch, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~trellm.generator.mtp.mtp_rows` on every rank (its MTP head is split as the layers are)."""
        from ..generator.mtp import mtp_rows

        self._send("mtp", {"batch": self._pack(batch), "hidden": _to_cpu(hidden)})
        return self._guarded(mtp_rows, self.local, batch, hidden)

    def load_lora(self, path: Any, name: str | None = None, scale: float = 1.0) -> str:
        """:meth:`LoraSet.load <trellm.lora.LoraSet.load>` on every rank, each keeping its part of the factors; all
        or none: when a rank refuses the adapter, the ranks that took it drop it and rank 0 raises the refusal."""
        from ..lora import PeftAdapter

        if not isinstance(path, PeftAdapter):  # the workers' working directory may differ; the name stays the given one's
            path, name = str(Path(path).absolute()), name or Path(path).name or None
        command = ("load", path, name, scale)
        self._send("lora", command)
        name, error = self._guarded(lora_command, self.comm, self.local, command)
        if error is not None:
            raise error
        return name

    def unload_lora(self, name: str) -> None:
        """:meth:`LoraSet.unload <trellm.lora.LoraSet.unload>` on every rank (an unknown name is refused here first)."""
        from ..lora import lora_set

        lora_set(self.local).slot(name)  # every rank holds the same adapters
        self._send("lora", ("unload", name))
        _, error = self._guarded(lora_command, self.comm, self.local, ("unload", name))
        if error is not None:
            raise error

    def close(self) -> None:
        """End the other ranks (waits for them; kills one that does not exit)."""
        self.workers.shutdown()


def lora_command(comm: Comm, model: Any, command: tuple) -> tuple[Any, Exception | None]:
    """Run ``command`` (("load", path, name, scale) or ("unload", name)) on this rank's LoraSet, then agree with the
    other ranks: when any rank failed, a rank that loaded the adapter unloads it, so every rank keeps the same
    adapters in the same slots (rank 0 names the slots of each batch's rows). Returns what the call returned and,
    on rank 0, the failure to raise (its own exception, or the first other rank's as a LoraError); another rank
    raises nothing (its loop goes on)."""
    from ..lora import LoraError, lora_set

    op, *args = command
    adapters = lora_set(model)
    result = error = None
    try:
        result = getattr(adapters, op)(*args)
    except Exception as e:  # noqa: BLE001 - any rank's failure is everyone's: reported below
        error = e
    failures = [(rank, why) for rank, why in enumerate(comm.all_gather_object(None if error is None else str(error)))
                if why is not None]
    if not failures:
        return result, None
    if error is None and op == "load":
        adapters.unload(result)
    if comm.rank > 0:
        return None, None
    if error is not None:
        return None, error
    rank, why = failures[0]
    return None, LoraError(f"tensor-parallel rank {rank} refused the LoRA {op}: {why} (no rank keeps it)")


def time_all_reduce(comm: Comm, model: Any, rows: int, reps: int) -> float:
    import statistics

    x = torch.ones(rows, model.config.hidden_size, dtype=model.embed.weight.dtype, device=comm.device)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        comm.all_reduce(x)
        if comm.device.type == "cuda":
            torch.cuda.synchronize(comm.device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


# ---- starting the ranks ---------------------------------------------------------------------------


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ)


def load_tensor_parallel(path: str | Path, world: int, device: Any, dtype: Any, progress: bool, tokenizer: bool,
                         step_timeout: float | None = None):
    """Rank 0's ``LoadedModel`` of ``path`` split over ``world`` ranks (see the module docstring)."""
    from .plan import device_and_dtype, refuse_unfit

    if world < 1:
        raise ValueError(f"tensor_parallel must be >= 1, got {world}")
    timeout = float(step_timeout or DEFAULT_STEP_TIMEOUT)
    dev, dt = device_and_dtype(Path(path), device, dtype)
    if dev.type == "cuda" and (dev.index or 0) + world > torch.cuda.device_count():
        raise TensorParallelError(
            f"tensor_parallel={world} from {dev} needs {world} GPUs, this machine has {torch.cuda.device_count()}"
        )
    refuse_unfit(path, world, dev, dt)
    spec = RankSpec(str(path), world, str(dev if dev.type == "cpu" else torch.device("cuda", dev.index or 0)),
                    str(dt).removeprefix("torch."), timeout)
    if dist.is_initialized() or under_torchrun():
        return _join_torchrun(spec, progress, tokenizer)
    return _spawn(spec, progress, tokenizer)


def _spawn(spec: RankSpec, progress: bool, tokenizer: bool):
    store = dist.TCPStore(spec.host, 0, spec.world, is_master=True, timeout=_seconds(spec.step_timeout),
                          wait_for_workers=False)
    spec = attrs.evolve(spec, port=store.port)
    # CPU ranks share the cores: each its share of threads, which sleep (not spin) between the steps' collectives
    threads = max(1, (os.cpu_count() or 1) // spec.world)
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    procs = [
        subprocess.Popen([sys.executable, "-m", "trellm.distributed.worker", str(rank), json.dumps(attrs.asdict(spec))],
                         env=env, stdin=subprocess.DEVNULL)
        for rank in range(1, spec.world)
    ]
    try:
        _wait_for(store, procs, "started", spec.step_timeout + 60.0)  # python + torch import
        comm = Comm(store, 0, spec.world, spec.rank_device(0), spec.step_timeout)
    except BaseException:
        _kill(procs)
        raise
    workers = WorkerGroup(comm, store, procs, spec.step_timeout)
    try:
        loaded = load_rank(spec, comm, progress, tokenizer)
        _wait_for(store, procs, "loaded", LOAD_TIMEOUT)
    except BaseException:
        workers.shutdown(graceful=False)
        raise
    loaded.model = TensorParallelModel(loaded.model, comm, workers)
    weakref.finalize(loaded, workers.shutdown)
    return loaded


_torchrun_models = itertools.count()


def _end_default_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _join_torchrun(spec: RankSpec, progress: bool, tokenizer: bool):
    """Every process of the launch loads its shard; ranks > 0 then serve rank 0 and exit when it closes."""
    if not dist.is_initialized():  # torchrun's rendezvous (env://); trellm's groups are made apart from it
        dist.init_process_group("gloo", timeout=_seconds(spec.step_timeout))
        # ours to end, before the interpreter's teardown: a gloo group destroyed there, its peers gone, aborts
        # the process ("terminate called without an active exception", about one exit in three)
        atexit.register(_end_default_group)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != spec.world:
        raise TensorParallelError(f"tensor_parallel={spec.world}, but the launch has {world} processes")
    device = torch.device("cpu")
    if torch.device(spec.device).type == "cuda":  # this process's GPU: its LOCAL_RANK
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
    store = dist.PrefixStore(f"{_KEY}/{next(_torchrun_models)}/", dist.distributed_c10d._get_default_store())
    comm = Comm(store, rank, world, device, spec.step_timeout, loopback=False)
    loaded = load_rank(spec, comm, progress and rank == 0, tokenizer and rank == 0)
    if rank != 0:
        serve(loaded.model, comm)
        comm.close()
        sys.exit(0)
    workers = WorkerGroup(comm, None, None, spec.step_timeout)
    loaded.model = TensorParallelModel(loaded.model, comm, workers)
    return loaded


def load_rank(spec: RankSpec, comm: Comm, progress: bool, tokenizer: bool):
    """This rank's LoadedModel: each top-level module loaded whole, then cut to this rank's shard."""
    from ..model import load_local
    from .sharding import shard_loaded_child

    dtype = getattr(torch, spec.dtype)
    return load_local(spec.model_dir, comm.device, dtype, progress, tokenizer, on_child_loaded=shard_loaded_child(comm))


def _seconds(s: float):
    import datetime

    return datetime.timedelta(seconds=s)


def _wait_for(store: Any, procs: list[subprocess.Popen], stage: str, timeout: float) -> None:
    """Wait until every worker has reached ``stage`` (it sets a store key); raise when one exits first."""
    keys = [f"{_KEY}/{stage}/{rank}" for rank in range(1, len(procs) + 1)]
    end = time.monotonic() + timeout
    while not store.check(keys):
        for rank, proc in enumerate(procs, start=1):
            code = proc.poll()
            if code is not None:
                time.sleep(0.1)
                _kill(procs)
                raise TensorParallelError(
                    f"tensor parallel over {len(procs) + 1} ranks could not start: "
                    + describe_exit(rank, proc.pid, code, read_error(store, rank))
                )
        if time.monotonic() > end:
            _kill(procs)
            raise TensorParallelError(f"tensor-parallel workers did not reach '{stage}' within {timeout:g} s")
        time.sleep(0.02)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


# ---- ranks > 0 ------------------------------------------------------------------------------------


def serve(model: Any, comm: Comm) -> None:
    """Run rank 0's steps until it sends "close" (raises when the group breaks)."""
    from ..generator.mtp import mtp_rows

    caches: dict[int, Any] = {}
    hidden = hidden_batch = None  # the last "hidden" step's, for the "logits_from_hidden" step after it

    def batch_of(packed: dict) -> ForwardBatch:
        batch = unpack_batch(packed, caches, comm.device)
        copy_state_slots(batch.cache, packed.get("state_copies", ()))
        return batch

    with torch.inference_mode():
        while True:
            step = comm.receive()
            for cache_id in step.dropped:
                caches.pop(cache_id, None)
            if step.kind == "forward":
                model.forward(batch_of(step.payload))
            elif step.kind == "hidden":
                hidden_batch = batch_of(step.payload)
                hidden = model.hidden_states(hidden_batch)
            elif step.kind == "logits_from_hidden":
                x, hidden = hidden if step.payload["hidden"] is None else step.payload["hidden"].to(comm.device), None
                indices = step.payload["logits_indices"]
                model.logits_from_hidden(x, attrs.evolve(hidden_batch, logits_indices=None if indices is None else indices.to(comm.device)))
            elif step.kind == "mtp":
                mtp_rows(model, batch_of(step.payload["batch"]), step.payload["hidden"].to(comm.device))
            elif step.kind == "cache":
                cache_id, made_with = step.payload
                caches[cache_id] = make_local_cache(model, made_with)
            elif step.kind == "all_reduce":
                time_all_reduce(comm, model, *step.payload)
            elif step.kind == "lora":
                lora_command(comm, model, step.payload)
            elif step.kind == "close":
                return
            else:
                raise TensorParallelError(f"unknown step {step.kind!r} from rank 0")


def _exit_with_parent() -> None:
    """End this worker when the process that started it is gone (it can no longer send steps)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os._exit(3)

    threading.Thread(target=watch, name="trellm-parent-watch", daemon=True).start()


def worker_main(rank: int, spec: RankSpec) -> None:
    """A started worker: join the group, load this rank's shard, serve rank 0 until it closes."""
    _exit_with_parent()
    store = dist.TCPStore(spec.host, spec.port, spec.world, is_master=False, timeout=_seconds(spec.step_timeout))
    try:
        device = spec.rank_device(rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        store.set(f"{_KEY}/started/{rank}", "1")
        comm = Comm(store, rank, spec.world, device, spec.step_timeout)
        loaded = load_rank(spec, comm, progress=False, tokenizer=False)
        store.set(f"{_KEY}/loaded/{rank}", "1")
        serve(loaded.model, comm)
    except BaseException as e:  # noqa: BLE001 - report to rank 0, then exit without waiting on the group
        text = "".join(traceback.format_exception(e))
        print(f"trellm tensor-parallel worker rank {rank}:\n{text}", file=sys.stderr, flush=True)
        try:
            store.set(f"{_KEY}/error/{rank}", f"{type(e).__name__}: {e}")
        except Exception:  # noqa: BLE001
            pass
        os._exit(1)
    comm.close()
    os._exit(0)
