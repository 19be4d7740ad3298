"""The extension points (``core.registry``): the built-in backends and families, and those an installed package
registers through entry points, found by the real ``importlib.metadata`` in a package installed on ``sys.path``."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError

from core import registry
from core.config import PlatformConfig
from core.failures import ConfigError

pytestmark = pytest.mark.unit

PLUGIN = '''
from training.models.pin_content import PinContentFamily


class ToyFamily(PinContentFamily):
    name = "toy"


class FakeBackend:
    name = "fake"

    def __init__(self, home):
        self.home = home

    @classmethod
    def from_config(cls, cfg, home=None):
        return cls(home or cfg.home)
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A package installed the way pip installs one: its module and a dist-info folder with its entry points."""
    (tmp_path / "pinflow_toy_plugin.py").write_text(PLUGIN)
    info = tmp_path / "pinflow_toy_plugin-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pinflow-toy-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent("""
        [pinflow.backends]
        fake = pinflow_toy_plugin:FakeBackend

        [pinflow.families]
        toy = pinflow_toy_plugin:ToyFamily
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    registry._installed.cache_clear()
    yield
    registry._installed.cache_clear()


def test_the_built_in_extensions_are_there_without_any_plugin() -> None:
    registry._installed.cache_clear()
    assert registry.names(registry.BACKENDS)[:3] == ("local", "batch", "kubernetes")
    assert {"pin_ranker", "pin_content"} <= set(registry.names(registry.FAMILIES))


def test_an_installed_package_adds_a_backend_and_a_family(plugin: None, tmp_path: Path) -> None:
    from operators.backends import backend_names, get_backend
    from training.sdk import load_family

    assert backend_names() == ("local", "batch", "kubernetes", "fake")
    cfg = PlatformConfig(storage_root=str(tmp_path / "storage"), home=str(tmp_path / "home"),
                         training={"backend": "fake"})
    backend = get_backend(cfg.training.backend, cfg)
    assert type(backend).__name__ == "FakeBackend" and backend.home == str(tmp_path / "home")
    family = load_family("toy")
    assert family.name == "toy" and family.dataset == load_family("pin_content").dataset


def test_an_unknown_backend_or_family_names_the_choices(plugin: None) -> None:
    from operators.backends import get_backend
    from training.sdk import load_family

    with pytest.raises(ConfigError, match=r"unknown compute backend 'slurm': choose one of local, batch, kubernetes, "
                                          r"fake \(param backend\)"):
        get_backend("slurm", PlatformConfig())
    with pytest.raises(ConfigError, match="unknown model family 'nope': choose one of pin_ranker, pin_content, toy"):
        load_family("nope")
    with pytest.raises(ValidationError, match="Input should be 'local', 'batch', 'kubernetes' or 'fake'"):
        PlatformConfig.model_validate({"training": {"backend": "slurm"}})


def test_the_scan_is_kept_until_a_package_is_installed_or_removed(plugin: None, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata
    import os
    import shutil

    assert "fake" in registry.names(registry.BACKENDS)  # scanned, and kept in the cache
    registry._installed.cache_clear()

    def no_scan(**_: object) -> object:
        raise AssertionError("scanned again although nothing was installed")

    monkeypatch.setattr(importlib.metadata, "entry_points", no_scan)
    assert "fake" in registry.names(registry.BACKENDS)  # a new process: read from the cache
    registry._installed.cache_clear()
    monkeypatch.undo()
    monkeypatch.syspath_prepend(str(tmp_path))
    shutil.rmtree(tmp_path / "pinflow_toy_plugin-0.1.dist-info")  # uninstalled: the folder on sys.path changed
    later = tmp_path.stat().st_mtime_ns + 10**9  # (file times are coarse: as if it happened a second later)
    os.utime(tmp_path, ns=(later, later))
    assert "fake" not in registry.names(registry.BACKENDS)


def test_a_damaged_cache_is_scanned_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from core.config_view import cache_dir

    monkeypatch.setenv("PINFLOW_HOME", str(tmp_path / "home"))
    cache = cache_dir() / registry.CACHE_NAME
    wrong_shape = json.dumps({"key": registry._installed_key(), "config": [1, 2]})
    for damaged in ("{not json", wrong_shape, "[]"):
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(damaged)
        registry._installed.cache_clear()
        assert registry.names(registry.BACKENDS)[:3] == ("local", "batch", "kubernetes")
    registry._installed.cache_clear()
