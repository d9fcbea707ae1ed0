"""AOT packages are code: one whose folder or file others can write to (or that another user
owns) is never loaded (one warning, the step runs eagerly). Fast: the check comes before loading,
so a file that is not a package shows which way it went ("did not load" means it was tried)."""

from __future__ import annotations

import logging

import pytest

from quickdraft import aot
from quickdraft.model.loader import load_model
from quickdraft.model.quant import prepare


@pytest.fixture
def model_and_package(target_dir, tmp_path, monkeypatch):
    folder = tmp_path / "aot"
    monkeypatch.setattr(aot, "aot_dir", lambda: folder)  # (the session fixture patches it too)
    model = prepare(load_model(target_dir, dtype="float32"))
    if aot.unsupported(model):
        pytest.skip(aot.unsupported(model))
    folder.mkdir(mode=0o700)
    path = aot.package_path(model)
    path.write_bytes(b"not a package")
    path.chmod(0o644)
    return model, folder, path


@pytest.mark.parametrize("folder_mode,file_mode", [(0o777, 0o644), (0o770, 0o644), (0o700, 0o666), (0o700, 0o664)])
def test_a_package_others_can_change_is_not_loaded(model_and_package, caplog, folder_mode, file_mode):
    model, folder, path = model_and_package
    folder.chmod(folder_mode)
    path.chmod(file_mode)
    try:
        with caplog.at_level(logging.WARNING, logger="quickdraft"):
            assert aot.load(model) is None
            assert aot.load(model) is None
    finally:
        folder.chmod(0o700)
    assert "did not load" not in caplog.text  # never handed to the loader
    assert caplog.text.count("not loaded from a folder or file others can change") == 1
    assert "writable by others" in caplog.text


def test_a_private_package_is_tried(model_and_package, caplog):
    model, _, _ = model_and_package
    with caplog.at_level(logging.WARNING, logger="quickdraft"):
        assert aot.load(model) is None  # (not a real package)
    assert "did not load" in caplog.text and "others can change" not in caplog.text
