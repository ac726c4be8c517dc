"""Models named by a Hugging Face Hub id (``org/name``): fetched through ``huggingface_hub`` into its cache.

``trellm generate -m org/name`` and ``trellm download org/name`` both land here. Files already in the
cache are not fetched again; offline (no network, or ``HF_HUB_OFFLINE=1``) the cached snapshot is used.
``HF_ENDPOINT`` points at a mirror, ``HF_TOKEN`` opens gated or private repos.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from .errors import ConfigError

# What trellm reads from a model repo: config, weights, tokenizer, chat template, generation and
# processor settings. Other formats (.bin, .gguf, .onnx, ...) stay on the Hub.
MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.tiktoken")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class HubError(ConfigError):
    """A Hub id that cannot be resolved: unknown repo, gated, offline and not cached, ..."""


def is_hub_id(text: str) -> bool:
    """``org/name`` the way the Hub spells repo ids (two parts, no leading ``.``, ``/`` or ``~``)."""
    return bool(_HUB_ID.fullmatch(text)) and ".." not in text


def download(repo_id: str, revision: str | None = None, progress: bool = True) -> Path:
    """The local snapshot folder of Hub model ``repo_id`` (fetched with progress bars if not cached)."""
    try:
        import huggingface_hub
        from huggingface_hub import constants as hub_constants
        from huggingface_hub import errors as hub_errors
    except ImportError:
        raise HubError(f"{repo_id!r} looks like a Hugging Face Hub id, and resolving it needs huggingface_hub: "
                       "pip install huggingface_hub") from None
    where = f"{repo_id!r} is not a local directory, and on the Hugging Face Hub ({hub_constants.ENDPOINT})"
    try:
        from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

        (enable_progress_bars if progress else disable_progress_bars)()
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=list(MODEL_FILES)))
    except hub_errors.GatedRepoError:
        raise HubError(f"{where} it is gated: accept its terms on the Hub, then set HF_TOKEN") from None
    except hub_errors.RepositoryNotFoundError:
        raise HubError(f"{where} there is no model by that id (a private one needs HF_TOKEN)") from None
    except hub_errors.RevisionNotFoundError:
        raise HubError(f"{where} it has no revision {revision!r}") from None
    except hub_errors.LocalEntryNotFoundError:
        raise HubError(f"{where} it is not in the local cache, and the Hub cannot be reached (offline, or "
                       "HF_HUB_OFFLINE=1)") from None
    except (hub_errors.HfHubHTTPError, OSError) as e:
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise HubError(f"{where} the download failed: {first_line}") from None


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("download", help="fetch a model from the Hugging Face Hub into its cache")
    p.add_argument("repo_id", help="Hub model id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct")
    p.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not is_hub_id(args.repo_id):
        print(f"trellm download: error: {args.repo_id!r} is not a Hub model id (org/name)", file=sys.stderr)
        return 2
    path = download(args.repo_id, args.revision)
    print(path)
    print(f"run it with: trellm chat -m {args.repo_id}", file=sys.stderr)
    return 0
