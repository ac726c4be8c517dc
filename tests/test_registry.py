"""The plugin registry: every hook is documented and exercised by registering throwaway plugins."""
import pytest

import trellm
from trellm import hookspecs, registry
from trellm.errors import UnknownArchitectureError


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
    for name in registry.HOOKS:
        spec = getattr(hookspecs, name)
        assert spec.__doc__ and "register(" in spec.__doc__, name
    declared = {n for n in dir(hookspecs) if n.startswith("trellm_")}
    assert declared == set(registry.HOOKS)


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
