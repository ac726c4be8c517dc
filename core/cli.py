"""The ``trellm`` command line.

Core commands live here; feature modules add theirs through ``add_cli(subparsers)`` (see
``SUBCOMMAND_MODULES``), plugins through the ``trellm_register_commands(subparsers)`` hook, each
setting ``func(args) -> int`` as its handler.
"""
from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
import traceback
from pathlib import Path

from .errors import ArchitectureConflictError, TrellmError, UnknownArchitectureError

SUBCOMMAND_MODULES = (
    "trellm.hub",
    "trellm.gguf",
    "trellm.convert",
    "trellm.evaluate",
    "trellm.kernels_cuda.cli",
    "trellm.server.cli",
    "trellm.bench",
)


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (exit code 2), not the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# ---- value types for flags: each names the rule a bad value breaks -------------------------------------


def positive_int(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {text}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(int, text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(float, text)
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def probability(text: str) -> float:
    value = _number(float, text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def gpu_split(text: str):
    """'auto' or GiB per device ("20,24")."""
    from .distributed.layer_split import parse_gpu_split

    try:
        return parse_gpu_split(text)
    except TrellmError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def device_name(text: str) -> str:
    """A device this process can use (checked before the model loads)."""
    from .model import resolve_device

    try:
        resolve_device(text)
    except TrellmError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


DTYPES = ("float32", "float16", "bfloat16", "fp32", "fp16", "bf16")


def _number(kind: type, text: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def _model_dir(args) -> Path:
    if args.model:
        from .model import model_path

        return model_path(args.model)
    from .default_model import default_model_dir

    return default_model_dir()


def _load(args):
    import trellm

    return trellm.load(_model_dir(args), device=args.device, dtype=args.dtype, progress=True, lora=getattr(args, "lora", None),
                       tensor_parallel=args.tp, gpu_split=args.gpu_split)


def _sampling(args) -> dict:
    return dict(
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )


def _user_message(text: str, images: list[str]) -> dict:
    """A chat message; with images, one {"type": "image"} part per image (the template writes its marker) before the text."""
    if not images:
        return {"role": "user", "content": text}
    return {"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}


def _refuse_images(lm, images: list[str]) -> None:
    """A clear error before a text-only model's chat template meets image parts it cannot render."""
    if images and not lm.takes_images:
        from .multimodal import ImageError

        raise ImageError(f"{lm.model_dir.name} ({lm.spec.name}) has no vision tower and takes no images; "
                         "use a vision model (docs/multimodal.md) or drop the image")


def cmd_generate(args) -> int:
    if not args.prompt.strip():
        print("trellm generate: error: the prompt is empty", file=sys.stderr)
        return 2
    lm = _load(args)
    _refuse_images(lm, args.image)
    prompt = args.prompt
    if args.chat:
        text = lm.tokenizer.apply_chat_template([_user_message(prompt, args.image)], add_generation_prompt=True)
        prompt = lm.tokenizer.encode(text, add_special_tokens=False)
    # without --chat the prompt itself must hold one image marker per --image
    for piece in lm.stream(prompt, stop=args.stop, images=args.image or None, **_sampling(args)):
        print(piece, end="", flush=True)
    print()
    return 0


def cmd_chat(args) -> int:
    lm = _load(args)
    tok = lm.tokenizer
    if tok is None or not tok.has_chat_template:
        print(f"error: {lm.model_dir} has no chat template; use `trellm generate`", file=sys.stderr)
        return 2
    _refuse_images(lm, args.image)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    images: list[str] = []  # every image of the conversation so far, in marker order
    queued = list(args.image)  # images for the next user message
    print(f"Chatting with {lm.model_dir.name}. /image PATH attaches an image to your next message, /reset clears the "
          "conversation, /exit (or Ctrl-D) quits.", file=sys.stderr)
    while True:
        try:
            user = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if user.strip() in ("/exit", "/quit"):
            return 0
        if user.strip() == "/reset":
            messages = messages[:1] if args.system else []
            images, queued = [], []
            continue
        if user.strip().startswith("/image"):
            path = user.strip()[len("/image"):].strip()
            if path and not lm.takes_images:
                print(f"error: {lm.model_dir.name} takes no images (no vision tower); the chat goes on without it",
                      file=sys.stderr)
            elif path:
                queued.append(path)
                print(f"(image {path} goes with your next message)", file=sys.stderr)
            else:
                print("usage: /image PATH", file=sys.stderr)
            continue
        if not user.strip():
            continue
        turn = [*messages, _user_message(user, queued)]
        ids = tok.encode(tok.apply_chat_template(turn, add_generation_prompt=True), add_special_tokens=False)
        reply = []
        try:
            for piece in lm.stream(ids, images=(images + queued) or None, **_sampling(args)):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            pass
        except TrellmError as e:  # a bad image: say so, keep the conversation as it was
            print(f"error: {e}", file=sys.stderr)
            queued = []
            continue
        messages = turn
        images, queued = images + queued, []
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def cmd_info(args) -> int:
    from . import registry
    from .config import read_config_json
    from .weights import WeightStore

    model_dir = _model_dir(args)
    raw = read_config_json(model_dir)
    arch = (raw.get("architectures") or ["?"])[0]
    spec = None
    try:
        claim = registry.resolve_architecture(arch, source=str(model_dir / "config.json"))
        served_by = f"plugin {claim.plugin!r} ({claim.spec.name})"
        spec = claim.spec
    except ArchitectureConflictError as e:
        served_by = f"CONFLICT: {e}"
    except UnknownArchitectureError:
        served_by = "NO INSTALLED PLUGIN (see `trellm plugins`)"
    store = WeightStore(model_dir)
    params = store.num_elements()
    weight_bytes = store.total_bytes()
    print(f"model:         {model_dir}")
    print(f"architecture:  {arch}")
    print(f"served by:     {served_by}")
    q = raw.get("quantization_config") or {}
    if q:
        print(f"quantization:  {q.get('quant_method', '?')} {q.get('bits', '')} bpw (head {q.get('head_bits', '?')})")
    print(f"tensors:       {len(store.keys())} in {len(store.files)} file(s)")
    print(f"parameters:    {params / 1e6:.1f} M stored elements")
    print(f"weights:       {_fmt_bytes(weight_bytes)} on disk")
    if spec is not None:
        cfg = spec.read_config(raw)
        cfg = getattr(cfg, "text", cfg)  # a vision-language config: its text model's sizes
        layers, kv, hd = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        print(f"layers:        {layers}, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}/{kv} (q/kv), head_dim {hd}")
        print(f"context:       {cfg.max_position_embeddings} positions, rope {cfg.rope.type} theta {cfg.rope.theta:g}")
        _print_memory_plan(args, model_dir)  # KV per token from the cache layers the model makes (MLA, recurrent, ...)
    return 0


def _print_memory_plan(args, model_dir: Path) -> None:
    """The memory plan per device (trellm.distributed.plan) and the largest context that fits."""
    from .distributed.plan import plan_layer_split, plan_memory

    if args.gpu_split:
        plan = plan_layer_split(model_dir, args.gpu_split, args.context, args.device, args.dtype)
        print(f"layer split:   over {len(plan.ranks)} device(s) for {args.context} tokens")
    else:
        plan = plan_memory(model_dir, args.tp, args.device, args.dtype)
        print(f"memory plan:   {'tensor parallel over ' + str(args.tp) + ' ranks' if args.tp > 1 else 'one device'}")
    for line in plan.lines(args.context):
        print(f"  {line}")
    fit = plan.max_context()
    if fit is not None:
        print(f"largest context that fits: {fit} tokens")



def cmd_plugins(args) -> int:
    from . import registry

    for info in registry.plugin_infos():
        version = f" {info.version}" if info.version else ""
        print(f"{info.name}{version}")
        for what, names in sorted(info.registers.items()):
            print(f"  {what}: {', '.join(names)}")
    return 0


def _add_model_args(p: argparse.ArgumentParser, sampling: bool = True) -> None:
    p.add_argument("-m", "--model", help="HF model directory or Hub id org/name (default: SmolLM2-135M-Instruct, imported on first use)")
    add_device_args(p)
    if sampling:
        p.add_argument("--lora", metavar="DIR", default=None, help="a PEFT LoRA adapter directory to run with")
        p.add_argument("--max-tokens", type=positive_int, default=256, help="most tokens to generate (default 256)")
        p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 = greedy")
        p.add_argument("--top-k", type=non_negative_int, default=0, help="0 = off")
        p.add_argument("--top-p", type=probability, default=1.0, help="in (0, 1]; 1 = off")
        p.add_argument("--seed", type=int, default=None)


def add_device_args(p: argparse.ArgumentParser) -> None:
    """--device, --dtype, --tp and --gpu-split, checked when parsed (every command that loads a model uses these)."""
    p.add_argument("--device", type=device_name, default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default: float32 on CPU, bf16 on GPU")
    p.add_argument("--tp", type=positive_int, default=1, metavar="N",
                   help="tensor parallel: split the model over N GPUs from --device (N processes with gloo on cpu)")
    p.add_argument("--gpu-split", type=gpu_split, default=None, metavar="auto|GB,GB,...",
                   help="layer split: the decoder layers in order over GPUs from --device, 'auto' (their free memory) "
                        "or GiB to use on each")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="trellm", description="Fast local LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("generate", help="complete a prompt")
    _add_model_args(p)
    p.add_argument("prompt")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="image for a vision model (repeatable); without --chat the prompt needs one image marker per image")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="multi-turn chat with the model's chat template")
    _add_model_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--image", action="append", default=[], metavar="PATH",
                   help="image for the first message (repeatable; vision models); /image PATH adds more later")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("info", help="which plugin serves a model, its size and memory plan")
    _add_model_args(p, sampling=False)
    p.add_argument("--context", type=int, default=4096, help="cache tokens the memory plan sizes for (default 4096)")
    p.set_defaults(func=cmd_info)

    p = sub.add_parser("plugins", help="list installed plugins and what they register")
    p.set_defaults(func=cmd_plugins)

    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.add_cli(sub)
    from . import registry

    registry.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one command: bad input is one ``error:`` line and exit code 2, never a traceback."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:  # `trellm info | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # as a process killed by SIGPIPE
    except (TrellmError, OSError) as e:  # bad input, or a file that cannot be read or written
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a bug: one line here, the traceback in a file for the report
        log = _write_crash_log(args)
        print(f"error: internal error ({type(e).__name__}: {e}); please report it with the traceback in {log}",
              file=sys.stderr)
        return 1


def _write_crash_log(args) -> Path:
    from .default_model import cache_dir

    path = cache_dir() / "logs" / f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"trellm {' '.join(sys.argv[1:])}\n{args}\n\n{traceback.format_exc()}")
    return path


if __name__ == "__main__":
    sys.exit(main())
