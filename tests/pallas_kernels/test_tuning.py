import json

import pytest

from pallas_kernels import tuning


def test_device_slug():
    assert tuning.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    assert tuning.device_slug("cpu") == "cpu"


def test_unknown_device_gives_empty():
    assert tuning.lookup("gated_delta_rule.triton", device_kind="no such device") == {}


def test_every_stored_table_is_well_formed():
    for path in tuning.TABLES.glob("*.json"):
        data = json.loads(path.read_text())
        assert isinstance(data, dict), path
        for op, classes in data.items():
            assert isinstance(classes, dict) and all(isinstance(v, dict) for v in classes.values()), (
                path,
                op,
            )


def test_shape_class_overrides_default(tmp_path, monkeypatch):
    (tmp_path / "dev.json").write_text(json.dumps({"op": {"default": {"a": 1, "b": 2}, "big": {"b": 3}}}))
    monkeypatch.setattr(tuning, "TABLES", tmp_path)
    tuning.table.cache_clear()
    try:
        assert tuning.lookup("op", device_kind="dev") == {"a": 1, "b": 2}
        assert tuning.lookup("op", "big", device_kind="dev") == {"a": 1, "b": 3}
        assert tuning.lookup("op", "other", device_kind="dev") == {"a": 1, "b": 2}
    finally:
        tuning.table.cache_clear()


def test_malformed_table_names_the_file(tmp_path, monkeypatch):
    (tmp_path / "bad.json").write_text("[1, 2]")
    monkeypatch.setattr(tuning, "TABLES", tmp_path)
    tuning.table.cache_clear()
    try:
        with pytest.raises(ValueError, match="bad.json"):
            tuning.lookup("op", device_kind="bad")
    finally:
        tuning.table.cache_clear()
