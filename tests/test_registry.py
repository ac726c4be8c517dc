"""The plugin registry: every hook is documented and exercised by registering throwaway plugins."""
import pytest

import trellm
from trellm import hookspecs, registry
from trellm.errors import ArchitectureConflictError, UnknownArchitectureError


@pytest.fixture
def throwaway():
    """Register a plugin object for one test, then remove it."""
    added = []

    def add(plugin, name):
        registry.load_plugins()
        registry.pm.register(plugin, name=name)
        added.append(plugin)
        return plugin

    yield add
    for p in added:
        registry.pm.unregister(p)


def test_every_hook_is_documented():
    for name in registry.REGISTER_HOOKS:
        spec = getattr(hookspecs, name)
        assert spec.__doc__ and "register(" in spec.__doc__, name
    assert "claims" in hookspecs.trellm_resolve_architecture.__doc__
    assert "subparsers.add_parser(" in hookspecs.trellm_register_commands.__doc__
    declared = {n for n in dir(hookspecs) if n.startswith("trellm_")}
    assert declared == {*registry.REGISTER_HOOKS, "trellm_resolve_architecture", "trellm_register_commands"}


def test_register_architectures_hook(throwaway):
    spec = trellm.ArchitectureSpec("toy", ("ToyForCausalLM",), read_config=dict, build=lambda c: c)

    class ToyPlugin:
        @trellm.hookimpl
        def trellm_register_architectures(self, register):
            register(spec)

    throwaway(ToyPlugin(), "toy-plugin")
    assert registry.architectures()["ToyForCausalLM"] == ("toy-plugin", spec)
    assert registry.find_architecture("ToyForCausalLM") is spec
    info = {i.name: i for i in registry.plugin_infos()}["toy-plugin"]
    assert info.registers == {"architectures": ["ToyForCausalLM"]}


def test_register_vision_towers_hook(throwaway):
    tower = trellm.VisionTowerSpec("toy-vit", ("toy_vit",), build=lambda *a: None)

    class ToyVision:
        @trellm.hookimpl
        def trellm_register_vision_towers(self, register):
            register(tower)

    throwaway(ToyVision(), "toy-vision")
    assert registry.vision_towers()["toy_vit"] is tower


def test_register_quant_formats_hook(throwaway):
    class ToyFormat:
        name = "toyq"

        def detect(self, store, key):
            return False

        def load_linear(self, *a, **k):
            raise AssertionError

    fmt = ToyFormat()

    class ToyQuant:
        @trellm.hookimpl
        def trellm_register_quant_formats(self, register):
            register(fmt)

    throwaway(ToyQuant(), "toy-quant")
    assert fmt in registry.quant_formats()


def test_register_samplers_hook(throwaway):
    def factory(**settings):
        return lambda logits, state: logits

    class ToySampler:
        @trellm.hookimpl
        def trellm_register_samplers(self, register):
            register("toy_step", factory)

    throwaway(ToySampler(), "toy-sampler")
    assert registry.samplers()["toy_step"] is factory


def test_unknown_architecture_lists_installed_and_explains():
    with pytest.raises(UnknownArchitectureError) as e:
        registry.find_architecture("NopeForCausalLM")
    msg = str(e.value)
    assert "NopeForCausalLM" in msg and "LlamaForCausalLM" in msg and "pip install" in msg


def test_loading_is_lazy_and_idempotent():
    pm1 = registry.load_plugins()
    n = len(pm1.get_plugins())
    assert registry.load_plugins() is pm1 and len(pm1.get_plugins()) == n


def test_allow_list_and_tracing_in_a_fresh_process(tmp_path):
    """TRELLM_PLUGINS limits which entry points load; TRELLM_TRACE_PLUGINS prints hook calls."""
    import os
    import subprocess
    import sys

    code = "from trellm import registry; print(sorted({plugin for plugin, _ in registry.architectures().values()}))"
    env = {**os.environ, "TRELLM_PLUGINS": "llama", "TRELLM_TRACE_PLUGINS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['llama']"
    assert "trellm_register_architectures" in out.stderr
    env = {**os.environ, "TRELLM_PLUGINS": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# ---- two plugins claiming one architecture -----------------------------------------------------------

CLASHING_PLUGIN = """
import trellm
from trellm.sdk import ArchitectureSpec, DecoderConfig, build_decoder

BUILT = []


def build(cfg):
    BUILT.append(cfg.architecture)
    return build_decoder(cfg)


SPEC = ArchitectureSpec("clash-llama", ("LlamaForCausalLM",), read_config=DecoderConfig.from_hf, build=build)


@trellm.hookimpl
def trellm_register_architectures(register):
    register(SPEC)
"""

RESOLVER_PLUGIN = """
import trellm


@trellm.hookimpl
def trellm_resolve_architecture(architecture, claims):
    return next((c for c in claims if c.plugin == "{pick}"), None)
"""

WRONG_RESOLVER_PLUGIN = """
import trellm


@trellm.hookimpl
def trellm_resolve_architecture(architecture, claims):
    return "clash-llama"  # a plugin name, not one of the claims
"""


def _module(tmp_path, name: str, source: str):
    """A real plugin module, written to disk and imported like an installed one."""
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_built_in_plugins_claim_each_architecture_once():
    shared = {arch: [c.plugin for c in claims] for arch, claims in registry.architecture_claims().items() if len(claims) > 1}
    assert not shared


def test_two_plugins_claiming_one_architecture_is_an_error_naming_both(throwaway, tmp_path):
    throwaway(_module(tmp_path, "clash_llama", CLASHING_PLUGIN), "clash-llama")
    with pytest.raises(ArchitectureConflictError) as e:
        registry.find_architecture("LlamaForCausalLM", source="m/config.json")
    msg = str(e.value)
    assert msg.startswith("m/config.json: ") and "'LlamaForCausalLM'" in msg
    assert "'llama' (spec 'llama')" in msg and "'clash-llama' (spec 'clash-llama')" in msg and "TRELLM_PLUGINS" in msg
    assert "LlamaForCausalLM" not in registry.architectures()
    assert registry.find_architecture("Qwen2ForCausalLM").name == "qwen2"  # other architectures still load


def test_a_resolver_hook_chooses_and_the_loader_follows_it(throwaway, tmp_path):
    from trellm.sdk.testing import make_tiny_hf_model

    clash = throwaway(_module(tmp_path, "clash_llama", CLASHING_PLUGIN), "clash-llama")
    throwaway(_module(tmp_path, "pick_clash", RESOLVER_PLUGIN.format(pick="clash-llama")), "pick-clash")
    assert registry.architectures()["LlamaForCausalLM"] == ("clash-llama", clash.SPEC)
    model_dir = make_tiny_hf_model("LlamaForCausalLM", tmp_path / "llama")
    trellm.load(model_dir, device="cpu", dtype="float32")
    assert clash.BUILT == ["LlamaForCausalLM"]


def test_a_resolver_answering_outside_the_claims_is_refused(throwaway, tmp_path):
    throwaway(_module(tmp_path, "clash_llama", CLASHING_PLUGIN), "clash-llama")
    throwaway(_module(tmp_path, "pick_by_name", WRONG_RESOLVER_PLUGIN), "pick-by-name")
    with pytest.raises(ArchitectureConflictError, match="none of its claims"):
        registry.find_architecture("LlamaForCausalLM")


# ---- plugin commands -----------------------------------------------------------------------------------

COMMANDS_PLUGIN = """
import trellm


def greet(args):
    print(f"hello {args.name}")
    return 3


@trellm.hookimpl
def trellm_register_commands(subparsers):
    p = subparsers.add_parser("greet", help="say hello")
    p.add_argument("--name", default="world")
    p.set_defaults(func=greet)
"""

CLASHING_COMMANDS_PLUGIN = """
import trellm


@trellm.hookimpl
def trellm_register_commands(subparsers):
    subparsers.add_parser("plugins")  # taken by core
"""


def test_a_plugin_adds_a_command(throwaway, tmp_path, capsys):
    from trellm import cli

    throwaway(_module(tmp_path, "greeter", COMMANDS_PLUGIN), "greeter")
    assert cli.main(["greet", "--name", "trellm"]) == 3
    assert capsys.readouterr().out == "hello trellm\n"


def test_a_plugin_command_clash_is_reported_and_the_cli_still_works(throwaway, tmp_path, capsys):
    from trellm import cli

    throwaway(_module(tmp_path, "clasher", CLASHING_COMMANDS_PLUGIN), "clasher")
    throwaway(_module(tmp_path, "greeter", COMMANDS_PLUGIN), "greeter")
    assert cli.main(["greet"]) == 3
    captured = capsys.readouterr()
    assert captured.out == "hello world\n"
    assert "plugin 'clasher' could not add its commands" in captured.err and "plugins" in captured.err
