"""``trellm serve``: the OpenAI-compatible server on uvicorn."""
from __future__ import annotations

import argparse
import logging
import sys

from .config import ServerConfig, load_config_file

# CLI flag -> ServerConfig field, for the flags whose value is taken as given
_FLAGS = ("model", "model_name", "host", "port", "api_key", "admin_key", "max_queue", "max_batch_size", "max_chunk_tokens",
          "cache_size", "page_size", "cache_bits", "draft_model", "num_draft_tokens", "lora", "device", "dtype", "tensor_parallel", "gpu_split",
          "default_max_tokens", "max_tokens_limit", "max_request_bytes", "max_prompt_bytes", "max_images",
          "max_image_pixels", "template_timeout_s", "template_memory_mb", "models_dir", "request_timeout_s",
          "keep_alive_timeout_s", "max_connections", "shutdown_grace_s", "max_failed_auth", "trusted_proxies", "log_level",
          "tool_parser", "reasoning_parser")


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server (needs the `server` extra)",
                              description="Serve a model over an OpenAI-compatible API. Settings come from defaults, "
                                          "then --config, then the flags given here.")
    p.add_argument("-m", "--model", help="HF model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model-name", help="id shown in /v1/models and expected in requests (default: directory name)")
    p.add_argument("--host", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 5000)")
    p.add_argument("--api-key", help="key for the API routes (default: generated and printed)")
    p.add_argument("--admin-key", help="key for the admin routes (default: generated and printed)")
    p.add_argument("--disable-auth", action="store_true", default=None, help="no keys at all (local use only)")
    p.add_argument("--max-queue", type=int, help="jobs that may wait beyond the running batch; more get 429 (default 64)")
    p.add_argument("--max-batch-size", type=int, help="jobs decoded together (default 16)")
    p.add_argument("--max-chunk-tokens", type=int, help="tokens per forward (prefill chunk budget, default 512)")
    p.add_argument("--cache-size", type=int, help="KV cache size in tokens (default 8192)")
    p.add_argument("--page-size", type=int, help="KV cache page size in tokens (default 256)")
    p.add_argument("--cache-bits", help="quantized KV cache: 'K,V' bits, e.g. 4,4 or 8,6 (default: fp16)")
    p.add_argument("--draft-model", help="HF directory of a draft model for speculative decoding; 'ngram': prompt lookup "
                                         "(copies what followed the last tokens' earlier occurrence; no model); 'mtp': the "
                                         "model's own multi-token-prediction head (Qwen3.5 checkpoints with mtp.* weights)")
    p.add_argument("--num-draft-tokens", type=int, help="draft tokens per step (default 4)")
    p.add_argument("--lora", action="append", metavar="NAME=DIR",
                   help="serve the PEFT LoRA adapter in DIR as model '<model-name>:NAME' (repeatable; several adapters "
                        "share one batch)")
    p.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--dtype", help="float32, float16 or bfloat16")
    p.add_argument("--tp", dest="tensor_parallel", type=int, metavar="N",
                   help="tensor parallel: split the model over N GPUs from --device (N gloo processes on cpu)")
    p.add_argument("--gpu-split", metavar="auto|GB,GB,...",
                   help="layer split: the decoder layers in order over GPUs from --device, 'auto' (their free memory) "
                        "or GiB to use on each; the plan keeps room for --cache-size tokens")
    p.add_argument("--default-max-tokens", type=int, help="chat completions without max_tokens stop here (default 512)")
    p.add_argument("--max-tokens-limit", type=int, help="the most new tokens one request may ask for (default: no limit)")
    p.add_argument("--accept-any-model-name", dest="strict_model_name", action="store_false", default=None,
                   help="serve requests whatever model name they give (default: 404 for another name)")
    p.add_argument("--tool-parser", help="tool-call format: hermes, llama3_json, mistral, harmony, deepseek_v3, glm45, "
                   "qwen3_coder (default: read from the chat template)")
    p.add_argument("--reasoning-parser", help="reasoning split: think, harmony or none (default: read from the chat template)")
    p.add_argument("--max-request-bytes", type=int, help="larger request bodies get 413 (default 4 MiB)")
    p.add_argument("--max-prompt-bytes", type=int, help="prompt text or message contents over this many UTF-8 bytes get "
                                                        "400 (default 1 MiB)")
    p.add_argument("--max-images", type=int, help="image parts per request (default 8)")
    p.add_argument("--max-image-pixels", type=int, help="width x height summed over a request's images (default 32 Mi)")
    p.add_argument("--allow-request-chat-template", dest="allow_request_chat_template", action="store_true", default=None,
                   help="accept 'chat_template' in requests (rendered in a subprocess with time and memory limits)")
    p.add_argument("--template-timeout", dest="template_timeout_s", type=float,
                   help="seconds a request's chat template may render (default 2)")
    p.add_argument("--template-memory-mb", type=int, help="memory limit of the request-template process (default 1024)")
    p.add_argument("--models-dir", help="directory whose subdirectories admin loads may name (default: no admin loads)")
    p.add_argument("--request-timeout", dest="request_timeout_s", type=float,
                   help="seconds a client has to send a whole request; slower connections are closed (default 30)")
    p.add_argument("--keep-alive-timeout", dest="keep_alive_timeout_s", type=float,
                   help="idle keep-alive connections are closed after this many seconds (default 5)")
    p.add_argument("--max-connections", type=int, help="open connections beyond this are closed at once (default 512)")
    p.add_argument("--shutdown-grace", dest="shutdown_grace_s", type=float,
                   help="on SIGTERM, seconds running requests get to finish before they are cancelled (default 10)")
    p.add_argument("--max-failed-auth", type=int,
                   help="failed authentications per client address per minute before it gets 429 (default 20)")
    p.add_argument("--trusted-proxies", help="addresses or networks of reverse proxies whose X-Forwarded-For names the "
                                             "client, comma-separated ('*': any, '': none; default 127.0.0.1)")
    p.add_argument("--log-level", help="debug, info, warning (default info)")
    p.add_argument("--config", help="YAML or JSON file with the same settings (underscored or dashed names)")
    p.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    config = ServerConfig()
    if getattr(args, "config", None):
        config = config.updated(load_config_file(args.config), args.config)
    given = {name: getattr(args, name) for name in _FLAGS if getattr(args, name, None) is not None}
    if getattr(args, "disable_auth", None):
        given["disable_auth"] = True
    if getattr(args, "strict_model_name", None) is False:
        given["strict_model_name"] = False
    if getattr(args, "allow_request_chat_template", None):
        given["allow_request_chat_template"] = True
    return config.updated(given, "command line")


def with_keys(config: ServerConfig) -> tuple[ServerConfig, list[str]]:
    """Generate the keys that were not given (unless auth is off); returns the lines that announce them."""
    from .auth import check_key_lengths, new_key

    if config.disable_auth:
        return config, ["authentication is DISABLED: every route is open"]
    check_key_lengths(config.api_key, config.admin_key)
    notes = []
    updates = {}
    if not config.api_key:
        updates["api_key"] = new_key()
        notes.append(f"generated API key:   {updates['api_key']}")
    if not config.admin_key:
        updates["admin_key"] = new_key()
        notes.append(f"generated admin key: {updates['admin_key']}")
    return (config.updated(updates, "generated keys") if updates else config), notes


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn  # noqa: F401
    except ImportError:
        print("error: `trellm serve` needs the server extra: pip install -e \".[server]\" in the trellm checkout", file=sys.stderr)
        return 2
    from .app import create_app
    from .http import serve

    config, notes = with_keys(config_from_args(args))
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for line in notes:
        print(line, file=sys.stderr, flush=True)
    app = create_app(config)
    print(f"trellm serve: http://{config.host}:{config.port}/v1 (health: /health, docs: /docs)", file=sys.stderr, flush=True)
    serve(app, config, host=config.host, port=config.port, log_level=config.log_level.lower()).run()
    return 0
