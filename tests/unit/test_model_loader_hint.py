"""A model loader the batcher cannot import (README "Adding a model"): its error says where the
batcher looked and what to do, not `No module named 'mypkg'` alone."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from asyncinfer.errors import ConfigError
from services.batcher.backends.torch_backend import import_factory

pytestmark = pytest.mark.unit


def test_a_loaders_package_not_found_says_to_install_it_or_put_it_on_pythonpath() -> None:
    """The first-hour pass, session 32: `make up CONFIG=my.toml` without PYTHONPATH printed `NOT LOADED:
    scale  model loader 'mypkg.models:build': cannot import 'mypkg.models': No module named 'mypkg'`."""
    with pytest.raises(ConfigError) as raised:
        import_factory("h3_no_such_pkg.models:build")
    assert str(raised.value) == (
        "model loader 'h3_no_such_pkg.models:build': cannot import 'h3_no_such_pkg.models': No module named "
        f"'h3_no_such_pkg' (the batcher imports with {sys.executable}: install 'h3_no_such_pkg' there "
        "(pip install -e) or put the folder holding it on PYTHONPATH)"
    )


def test_a_module_the_loaders_package_imports_not_found_says_to_install_that(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "h3_found_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text("import h3_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as raised:
        import_factory("h3_found_pkg.models:build")
    assert str(raised.value).endswith(
        f"No module named 'h3_missing_dependency' (the batcher imports with {sys.executable}: "
        "install 'h3_missing_dependency' there)"
    ), raised.value
