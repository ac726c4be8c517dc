"""The real `trellm` command on bad input: one clear line on stderr, exit code 2, never a traceback.

Every case runs as its own process (the installed CLI, as a user types it); they start together so
the whole file costs about one CLI start-up per core.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

CLI = [sys.executable, "-m", "trellm.cli"]


def _start(args: list[str], stdin: bool = False) -> subprocess.Popen:
    return subprocess.Popen([*CLI, *args], stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _error_lines(stderr: str) -> list[str]:
    """stderr without the model-loading progress line."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith("loading ")]


@pytest.fixture(scope="module")
def model(tiny_llama_smollm2_tokenizer_dir) -> Path:
    return tiny_llama_smollm2_tokenizer_dir  # 1,024 positions, SmolLM2's tokenizer and chat template, no vision


@pytest.fixture(scope="module")
def bad_inputs(model, tmp_path_factory) -> dict[str, tuple[list[str], str]]:
    """case -> (arguments, a phrase the one error line must hold)."""
    tmp = tmp_path_factory.mktemp("cli_errors")
    (tmp / "model.gguf").write_bytes(b"GGUF")
    started = tmp / "started_job"
    (started / "ckpt").mkdir(parents=True)
    broken = tmp / "broken"  # loads until the first layer's weights, which are missing
    broken.mkdir()
    (broken / "config.json").write_text((model / "config.json").read_text())
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(model / "model.safetensors"))
    save_file({k: v for k, v in tensors.items() if ".layers.0.self_attn.q_proj" not in k}, str(broken / "model.safetensors"))
    cuda = "cuda:99" if torch.cuda.is_available() else "cuda"
    m = ["-m", str(model)]
    return {
        "negative temperature": (["generate", *m, "--temperature", "-1", "hi"], "--temperature: must be 0 or more"),
        "unknown dtype": (["generate", *m, "--dtype", "float8", "hi"], "invalid choice: 'float8'"),
        "unavailable device": (["generate", *m, "--device", cuda, "hi"], "is not available"),
        "unknown device": (["info", *m, "--device", "tpu"], "device 'tpu'"),
        "empty prompt": (["generate", *m, ""], "the prompt is empty"),
        "negative max tokens": (["generate", *m, "--max-tokens", "-1", "hi"], "--max-tokens: must be 1 or more"),
        "top-p above 1": (["generate", *m, "--top-p", "2", "hi"], "--top-p: must be in (0, 1]"),
        "top-k not a number": (["generate", *m, "--top-k", "many", "hi"], "expected an integer"),
        "eval window of 0": (["eval", *m, "--seq-len", "0"], "--seq-len: must be 1 or more"),
        "gguf file as model": (["generate", "-m", str(tmp / "model.gguf"), "hi"], "trellm import-gguf"),
        "file as model": (["info", "-m", str(model / "config.json")], "is a file; pass a model directory"),
        "missing model dir": (["info", "-m", str(tmp / "nowhere")], "does not exist"),
        "prompt longer than context": (["generate", *m, "word " * 1100], "but the model's context is 1,024 positions"),
        "image for a text model": (["generate", *m, "--chat", "--image", str(tmp / "x.png"), "hi"], "no vision tower"),
        "load error": (["generate", *m[:1], str(broken), "hi"], "q_proj"),
        "convert work dir is the output": (["convert", "-i", str(model), "-o", str(tmp / "q"), "-w", str(tmp / "q"), "-b", "4"],
                                           "is also the -o/--output directory"),
        "convert over a started job": (["convert", "-i", str(model), "-o", str(tmp / "q2"), "-w", str(started), "-b", "4"],
                                       "resume it with -r"),
        "build-kernels bad arch": (["build-kernels", "--arch", "turing"], "--arch sm_"),
    }


def test_each_bad_input_is_one_clear_line_and_exit_code_2(bad_inputs):
    procs = {case: _start(args) for case, (args, _) in bad_inputs.items()}
    failures = []
    for case, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        lines, phrase = _error_lines(err), bad_inputs[case][1]
        if proc.returncode != 2 or "Traceback" in err or len(lines) != 1 or phrase not in lines[0]:
            failures.append(f"{case}: exit {proc.returncode}, stderr {err!r}")
        elif not lines[0].startswith(("error:", "trellm ")):
            failures.append(f"{case}: the line does not say it is an error: {lines[0]!r}")
    assert not failures, "\n".join(failures)


def test_reader_closing_the_pipe_is_not_an_error(model):
    """`trellm info | head -1`: the reader leaves early; no traceback, no message."""
    proc = _start(["info", "-m", str(model)])
    proc.stdout.close()  # every write now fails with EPIPE
    err = proc.stderr.read()
    assert proc.wait(timeout=300) == 141 and err == ""


def test_chat_refuses_an_image_for_a_text_model_and_goes_on(model):
    proc = _start(["chat", "-m", str(model), "--max-tokens", "3", "--seed", "0"], stdin=True)
    out, err = proc.communicate("/image photo.png\nhello\n/exit\n", timeout=300)
    assert proc.returncode == 0 and "Traceback" not in err
    assert "takes no images (no vision tower); the chat goes on" in err
    assert out.count(">>> ") == 3 and out.split(">>> ")[2].strip()  # the reply to "hello" came


def test_api_checks_prompt_length_and_arguments(model):
    import trellm
    from trellm.errors import PromptTooLongError, UsageError

    lm = trellm.load(model, device="cpu")
    with pytest.raises(PromptTooLongError, match="1,030 tokens but the model's context is 1,024 positions"):
        lm.generate([5] * 1030)
    with pytest.raises(PromptTooLongError, match="1,025 tokens"):
        lm.logits([[5] * 1025])
    assert lm.logits([[5] * 1024]).shape[1] == 1024  # the whole context is usable for scoring
    with pytest.raises(UsageError, match="the prompt is empty"):
        lm.generate([])
    with pytest.raises(UsageError, match="max_new_tokens must be >= 0"):
        lm.generate("hi", max_new_tokens=-1)
    with pytest.raises(UsageError, match="unsupported dtype 'float8'"):
        trellm.load(model, dtype="float8")
    # the reply stops where the context ends
    ids = list(lm.generate_ids([5] * 1020, max_new_tokens=50, stop_token_ids=[]))
    assert len(ids) == 4

    from trellm.generator import Generator, Job, JobTooLargeError

    gen = Generator(lm, cache_tokens=4096)
    with pytest.raises(JobTooLargeError, match="1,024 positions"):
        gen.enqueue(Job([5] * 1024, max_new_tokens=4))


def test_load_error_does_not_share_the_progress_line(model, tmp_path, capsys):
    import trellm
    from trellm.errors import TrellmError

    (tmp_path / "config.json").write_text(json.dumps({**json.loads((model / "config.json").read_text()), "vocab_size": 7}))
    (tmp_path / "model.safetensors").symlink_to(model / "model.safetensors")
    with pytest.raises(TrellmError):
        trellm.load(tmp_path, progress=True)
    assert capsys.readouterr().err.endswith("\n")
