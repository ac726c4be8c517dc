"""Loading a model directory and the simple public API (logits, generate)."""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Iterator, Sequence

import torch

from . import registry
from .capabilities import config_stop_ids, is_hybrid
from .batch import ForwardBatch
from .cache import KVCache, SequenceState
from .config import read_config_json
from .errors import ConfigError, PromptTooLongError, TokenizerError, UsageError
from .modules.base import LoadContext
from .sampling import StopStringMatcher, sample_token
from .weights import WeightStore

PREFILL_CHUNK = 2048


def resolve_device(device) -> torch.device:
    """``device`` as a torch.device this process can use (None: cuda when available); UsageError otherwise."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UsageError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA support; install a CUDA build of torch (see the README)"
                   if torch.version.cuda is None else "no CUDA GPU is visible (driver, CUDA_VISIBLE_DEVICES?)")
            raise UsageError(f"device {device!r} is not available: {why}, or use --device cpu")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise UsageError(f"device {device!r} is not available: {count} CUDA device(s) visible (cuda:0..cuda:{count - 1})")
    elif dev.type != "cpu":
        raise UsageError(f"device {device!r} is not supported; use cpu, cuda or cuda:N")
    return dev


def _resolve_dtype(dtype, device: torch.device, config_dtype: str | None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        try:
            return {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
                    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}[dtype]
        except KeyError:
            raise UsageError(f"unsupported dtype {dtype!r}; use float32, float16 or bfloat16") from None
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and lossy
    return torch.float16 if config_dtype == "float16" else torch.bfloat16


def context_length(config) -> int | None:
    """How many positions the model was trained for (``max_position_embeddings``); None where the
    config sets no bound (dynamic NTK RoPE stretches to any length)."""
    rope = getattr(config, "rope", None)
    if getattr(rope, "type", None) == "dynamic":
        return None
    limit = getattr(config, "max_position_embeddings", None)
    return int(limit) if limit else None


def prompt_too_long(prompt_tokens: int, config, reply_tokens: int = 1) -> str | None:
    """Why ``prompt_tokens`` tokens plus ``reply_tokens`` positions for the reply do not fit the context of a
    model with this config, or None when they do."""
    limit = context_length(config)
    if limit is None or prompt_tokens + reply_tokens <= limit:
        return None
    room = " to leave room for a reply" if reply_tokens else ""
    return (f"the prompt is {prompt_tokens:,} tokens but the model's context is {limit:,} positions "
            f"(max_position_embeddings); shorten it to at most {limit - reply_tokens:,} tokens{room}")


class LoadedModel:
    """A loaded model: ``.model`` (modules), ``.tokenizer``, ``.config``, plus convenience calls."""

    def __init__(self, model_dir: Path, raw_config: dict, spec, config, model, store: WeightStore, tokenizer, device, dtype):
        self.model_dir, self.raw_config, self.spec, self.config = model_dir, raw_config, spec, config
        self.model, self.store, self.tokenizer, self.device, self.dtype = model, store, tokenizer, device, dtype
        self._cache: KVCache | None = None
        self._runner = None
        self.default_lora: str | None = None  # the adapter simple calls and Generator jobs use unless they name one

    def __repr__(self) -> str:
        return f"<trellm model {self.model_dir.name} ({self.spec.name}) on {self.device} {self.dtype}>"

    # ---- LoRA adapters ------------------------------------------------------------------------------

    def load_lora(self, path, name: str | None = None, scale: float = 1.0) -> str:
        """Load the PEFT LoRA adapter in directory ``path`` beside the base weights, under ``name`` (default: the
        directory's name); ``scale`` multiplies its update. Returns the name. Jobs choose it with
        ``Job(lora=name)``, simple calls with ``lora=name``; several adapters serve one batch together."""
        from .distributed import TensorParallelModel
        from .lora import lora_set

        if isinstance(self.model, TensorParallelModel):  # every rank its part, all or none
            return self.model.load_lora(path, name=name, scale=scale)
        return lora_set(self.model).load(path, name=name, scale=scale)

    def unload_lora(self, name: str) -> None:
        """Unload adapter ``name`` (jobs still running with it fail); raises LoraError for an unknown name."""
        from .lora import lora_set

        adapters = lora_set(self.model, create=False)
        if adapters is None:
            from .lora import LoraError

            raise LoraError(f"no LoRA adapter named {name!r} is loaded; loaded: none")
        from .distributed import TensorParallelModel

        if isinstance(self.model, TensorParallelModel):
            self.model.unload_lora(name)
        else:
            adapters.unload(name)
        if self.default_lora == name:
            self.default_lora = None

    @property
    def loras(self) -> list[str]:
        """Names of the loaded LoRA adapters."""
        from .lora import lora_set

        adapters = lora_set(self.model, create=False)
        return adapters.names() if adapters is not None else []

    def _with_lora(self, batch: ForwardBatch, lora: str | None) -> ForwardBatch:
        """``batch`` with every token on adapter ``lora`` (None: the default adapter; "": the base model)."""
        from .lora import lora_set

        adapters = lora_set(self.model, create=False)
        name = self.default_lora if lora is None else (lora or None)
        if adapters is None:
            if name is not None:
                from .lora import LoraError

                raise LoraError(f"no LoRA adapter named {name!r} is loaded; loaded: none")
            return batch
        batch.lora_slots = torch.full((batch.num_tokens,), adapters.slot(name), dtype=torch.long, device=batch.input_ids.device)
        return batch

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor | Sequence[Sequence[int]], images=None, lora: str | None = None) -> torch.Tensor:
        """Float32 logits [batch, seq, vocab] for whole sequences (no cache). Shorter rows are right-padded with 0.
        ``lora``: the adapter to run with (None: the default one, if any; "": the base model).

        ``images``: per sequence, a list of images for its image markers (multimodal models); the
        rows are then those of the expanded prompts (see ``trellm.multimodal``).
        """
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() == 1:
                input_ids = input_ids[None]
            seqs = input_ids.tolist()
        else:
            seqs = [list(s) for s in input_ids]
        prompts = None
        if images is not None:  # multimodal: expand markers, inject image embeddings
            from .multimodal import attach_images, prepare_prompt

            prompts = [prepare_prompt(self, s, imgs) if imgs else None for s, imgs in zip(seqs, images)]
            seqs = [p.input_ids if p is not None else s for p, s in zip(prompts, seqs)]
        for seq in seqs:
            if not seq:
                raise UsageError("logits: a sequence is empty")
            if (why := prompt_too_long(len(seq), self.model.config, reply_tokens=0)) is not None:
                raise PromptTooLongError(f"logits: {why}")
        batch = self._with_lora(ForwardBatch.no_cache(seqs, self.device), lora)
        if prompts is not None:
            attach_images(batch, [(p, 0) for p in prompts])
        flat = self.model.forward(batch)
        out = torch.zeros(len(seqs), max(len(s) for s in seqs), flat.shape[-1], dtype=torch.float32, device=flat.device)
        bounds = batch.cu_seqlens.tolist()
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            out[i, : b - a] = flat[a:b]
        return out

    def new_cache(self, max_tokens: int = 8192, page_size: int = 256, **kwargs) -> KVCache:
        if is_hybrid(self.model):  # hybrid models add recurrent-state layers
            return self.model.make_cache(max_tokens=max_tokens, page_size=page_size, **kwargs)
        return KVCache.for_model(self.model, max_tokens=max_tokens, page_size=page_size, **kwargs)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise TokenizerError(f"{self.model_dir}: model has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    @torch.inference_mode()
    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        cache: KVCache | None = None,
        images=None,
        lora: str | None = None,
    ) -> Iterator[int]:
        """Yield generated token ids one at a time (prefill in chunks, then cached decode).

        ``images``: one per image marker of the prompt (multimodal models), or a prepared
        ``MultimodalPrompt``; the prompt is expanded and prefilled in one chunk with the image embeddings.
        """
        if not prompt_ids:
            raise UsageError("the prompt is empty")
        if max_new_tokens < 0:
            raise UsageError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        mm = None
        if images:
            from .multimodal import MultimodalPrompt, attach_images, prepare_prompt

            mm = images if isinstance(images, MultimodalPrompt) else prepare_prompt(self, prompt_ids, images)
            prompt_ids = mm.input_ids
        if (why := prompt_too_long(len(prompt_ids), self.model.config)) is not None:
            raise PromptTooLongError(why)
        if (limit := context_length(self.model.config)) is not None:  # the reply stops where the context ends
            max_new_tokens = min(max_new_tokens, limit - len(prompt_ids))
        stops = set(stop_token_ids if stop_token_ids is not None else self.default_stop_ids())
        forward = self.model.forward
        if cache is None:
            cache, runner = self._session_cache(len(prompt_ids) + max_new_tokens)
            if runner is not None:
                forward = runner.forward
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        seq = SequenceState(cache, with_state_slot=True)
        try:
            pending = list(prompt_ids)
            for _ in range(max_new_tokens):
                logits = None
                while pending:
                    size = len(pending) if mm is not None and seq.length == 0 else PREFILL_CHUNK
                    chunk, pending = pending[:size], pending[size:]
                    seq.reserve(seq.length + len(chunk))
                    slots = None if seq.state_slot is None else [seq.state_slot]
                    batch = ForwardBatch.with_cache([chunk], [seq.length], [seq.pages], cache, state_slots=slots)
                    batch = self._with_lora(batch, lora)
                    if mm is not None:  # image rows (prefill) and family positions (every step)
                        attach_images(batch, [(mm, seq.length)])
                    logits = forward(batch)[-1]
                    seq.length += len(chunk)
                token = sample_token(logits, temperature, top_k, top_p, gen)
                yield token
                if token in stops:
                    return
                pending = [token]
        finally:
            seq.release()

    def _session_cache(self, tokens: int):
        """A cache (and, on CUDA, a decode-graph runner) kept across simple generate calls."""
        if self._cache is None or self._cache.num_pages * self._cache.page_size < tokens + self._cache.page_size:
            from .graph import GraphRunner

            if self._runner is not None:
                self._runner.close()
            floor = 8192 if self.device.type == "cuda" else 1024  # CPU: keep memory small, grow on demand
            self._cache = self.new_cache(max_tokens=max(floor, 2 * tokens) + 256)
            capturable = self.device.type == "cuda" and getattr(self.model, "capturable", True)
            self._runner = GraphRunner(self.model, self._cache, batch_sizes=(1,)) if capturable else None
        return self._cache, self._runner

    def default_stop_ids(self) -> set[int]:
        ids = config_stop_ids(self.config)
        if self.tokenizer is not None:
            ids |= set(self.tokenizer.eos_token_ids)
        return ids

    def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        stop: Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        seed: int | None = None,
        images=None,
        lora: str | None = None,
    ) -> Iterator[str]:
        """Yield generated text pieces as they complete (never a split UTF-8 character or a partial stop string).

        ``images``: file paths, bytes, data URLs or PIL images, one per image marker in ``prompt``.
        """
        ids = self.encode_prompt(prompt)
        if images:  # text-level placeholder expansion, as the HF processor does
            from .multimodal import prepare_prompt

            mm = prepare_prompt(self, prompt, images)
            ids, images = mm.input_ids, mm
        stops = set(stop_token_ids) if stop_token_ids is not None else self.default_stop_ids()
        decoder = self.tokenizer.stream()
        matcher = StopStringMatcher(list(stop or []))
        for token in self.generate_ids(ids, max_new_tokens, temperature, top_k, top_p, list(stops), seed, images=images,
                                       lora=lora):
            if token in stops:
                break
            text, stopped = matcher.feed(decoder.push(token))
            if text:
                yield text
            if stopped:
                return
        text, stopped = matcher.feed(decoder.flush())
        if text:
            yield text
        if not stopped and (rest := matcher.flush()):
            yield rest

    def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 128, temperature: float = 0.0, **kwargs) -> str:
        """Generated text (without the prompt); ``temperature=0`` is greedy."""
        return "".join(self.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature, **kwargs))

    @property
    def takes_images(self) -> bool:
        """Whether the model has a vision tower (image markers in a prompt are filled with image embeddings)."""
        from .capabilities import supports_images

        return supports_images(self.model)  # a tensor-parallel model's too (rank 0 holds the tower)

    def num_parameters(self) -> int:
        return self.store.num_elements()

    def close(self) -> None:
        """End what this model holds beyond its memory: a tensor-parallel model's other ranks."""
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        close = getattr(self.model, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "LoadedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()



def note_decoded(ctx: LoadContext, what: str, stacklevel: int = 2) -> None:
    """One line on the memory that quantized weights decoded at load take (a format with no kernel on the
    device, as EXL3 on a CPU: decoding once beats decoding every weight at every forward). ``what``: the
    format's name for the user."""
    if not ctx.decoded_nbytes:
        return
    import warnings

    from .distributed.plan import gib

    warnings.warn(f"{what} weights on {ctx.device.type} (no kernel there): decoded once at load to "
                  f"{str(ctx.dtype).removeprefix('torch.')}, {gib(ctx.decoded_nbytes)} of memory", stacklevel=stacklevel + 1)


def model_path(path: str | Path) -> Path:
    """The model directory ``path`` names: a local folder, or a Hugging Face Hub id (``org/name``) that is not
    one, fetched into the Hub cache; a clear ConfigError for a file (a GGUF needs importing first)."""
    model_dir = Path(path).expanduser()
    if not model_dir.exists() and isinstance(path, str):
        from . import hub

        if hub.is_hub_id(path):
            return hub.download(path)
    if model_dir.is_file():
        if model_dir.suffix.lower() == ".gguf":
            raise ConfigError(f"{model_dir} is a GGUF file; trellm loads Hugging Face model directories: import it with "
                              f"`trellm import-gguf {model_dir} -o DIR` and pass -m DIR")
        raise ConfigError(f"{model_dir} is a file; pass a model directory (one holding config.json and *.safetensors)")
    return model_dir


def load(path: str | Path, device=None, dtype=None, progress: bool = False, tokenizer: bool = True,
         lora: str | Path | None = None, weights: bool = True, tensor_parallel: int = 1,
         step_timeout: float | None = None, gpu_split: str | Sequence[float] | None = None,
         context: int = 8192) -> LoadedModel:
    """Load an HF model directory (bf16/fp16/fp32 safetensors, or EXL3) with the plugin that serves it.

    ``lora``: a PEFT LoRA adapter directory loaded beside the base weights and used by default
    (``LoadedModel.load_lora`` adds more). ``weights=False`` builds the modules without loading any
    tensor (the converter loads one layer at a time).
    ``tensor_parallel=N``: split the model over N ranks (N GPUs from ``device``, or N CPU processes with
    gloo); trellm starts the other ranks itself (or joins a ``torchrun`` launch). ``step_timeout``: seconds
    a step may wait on another rank before the model is ended with an error. ``close()`` ends the ranks.
    ``gpu_split``: spread the decoder layers in order over several devices from ``device`` (cuda:k, cuda:k+1, ...;
    on "cpu" each entry is a stage on the CPU): "auto" fills each GPU's free memory, a list gives the GiB to use
    on each; the plan keeps room for ``context`` tokens of KV cache and refuses before allocating when the model
    does not fit (trellm.distributed.layer_split).
    """
    model_dir = model_path(path)
    if gpu_split is not None:
        from .distributed.layer_split import load_layer_split

        if tensor_parallel != 1:
            from .distributed import TensorParallelError

            raise TensorParallelError(f"gpu_split and tensor_parallel={tensor_parallel} cannot be combined yet: a layer "
                                      "split runs in one process, tensor parallel in one per GPU; choose one")
        if not weights:
            raise UsageError("gpu_split places loaded weights; load with weights=True")
        lm = load_layer_split(model_dir, gpu_split, device, dtype, progress, tokenizer, context)
        if lora is not None:
            lm.default_lora = lm.load_lora(lora)
        return lm
    if tensor_parallel != 1:
        from .distributed import TensorParallelError, load_tensor_parallel

        if not weights:
            raise TensorParallelError("tensor parallel loads the whole model's weights (weights=False is not supported)")
        lm = load_tensor_parallel(model_dir, tensor_parallel, device, dtype, progress, tokenizer, step_timeout)
        if lora is not None:
            try:
                lm.default_lora = lm.load_lora(lora)
            except BaseException:
                lm.close()  # the workers end with the refusal
                raise
        return lm
    dev = resolve_device(device)
    if dev.type == "cuda" and weights:
        from .distributed.plan import device_and_dtype, refuse_unfit

        refuse_unfit(model_dir, 1, *device_and_dtype(model_dir, dev, dtype))
    lm = load_local(model_dir, dev, dtype, progress, tokenizer, weights=weights)
    if lora is not None:
        lm.default_lora = lm.load_lora(lora)
    return lm


def load_local(path: str | Path, dev: torch.device, dtype, progress: bool, tokenizer: bool,
               on_child_loaded=None, store: WeightStore | None = None, weights: bool = True, placement=None) -> LoadedModel:
    """:func:`load` on one device. ``on_child_loaded(model, child, ctx)`` runs after each top-level module
    loads (tensor parallel cuts it to this rank's shard there, before the next one loads); ``store``: where
    tensors come from (the memory plan reads shapes only); ``placement(model, child)``: the device each top-level
    module loads onto (a layer split; default ``dev``)."""
    model_dir = Path(path)
    raw = read_config_json(model_dir)
    archs = raw.get("architectures") or []
    if not archs:
        raise ConfigError(f"{model_dir / 'config.json'}: no 'architectures' entry; cannot tell which plugin serves it")
    spec = registry.find_architecture(archs[0], source=str(model_dir / "config.json"))
    config = spec.read_config(raw)
    dt = _resolve_dtype(dtype, dev, getattr(config, "torch_dtype", None))
    store = store or WeightStore(model_dir)
    model = spec.build(config)
    ctx = LoadContext(store=store, device=dev, dtype=dt, quant_formats=registry.quant_formats())
    t0 = time.time()
    children = list(model.children()) if weights else []
    try:
        for i, child in enumerate(children):
            if placement is not None:
                ctx.device = placement(model, child)
            child.load(ctx)
            if on_child_loaded is not None:
                on_child_loaded(model, child, ctx)
            if progress:
                print(f"\rloading {model_dir.name}: {i + 1}/{len(children)} modules", end="", file=sys.stderr, flush=True)
    except BaseException:
        if progress:  # an error message must not land on the progress line
            print(file=sys.stderr)
        raise
    if progress:
        print(f" ({time.time() - t0:.1f}s)", file=sys.stderr)
    quant = raw.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    note_decoded(ctx, str(method).upper() if method else "quantized", stacklevel=4)
    tok = None
    if tokenizer:
        if (model_dir / "tokenizer.json").is_file():
            from .tokenizer import Tokenizer

            tok = Tokenizer.from_dir(model_dir, vocab_size=getattr(config, "vocab_size", None))
    return LoadedModel(model_dir, raw, spec, config, model, store, tok, dev, dt)
