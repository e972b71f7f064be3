"""Device kinds of the tuning tables: a device's key and an op's table filled from its
records."""

from __future__ import annotations

from lazyspec.kernels.device_kinds import DEVICE_KINDS, device_kind_key, device_table


def test_a_table_has_every_kind_and_falls_back_as_the_key_does() -> None:
    assert device_table("g") == dict.fromkeys(DEVICE_KINDS, "g")
    table = device_table("g", tpu="t", cpu="c")
    assert table == {"h100": "g", "h200": "g", "tpu_v5e": "t", "tpu_v6e": "t", "cpu": "c"}
    assert device_table("g", tpu="t", tpu_v6e="t6")["tpu_v6e"] == "t6"
    assert device_table("g", tpu_v6e="t6")["tpu_v5e"] == "g"


def test_device_kind_key() -> None:
    assert device_kind_key("gpu", "NVIDIA H200") == "h200"
    assert device_kind_key("cuda", "NVIDIA H100 80GB HBM3") == "h100"
    assert device_kind_key("rocm", "MI300X") == "h100"  # an untimed GPU takes the H100's
    assert device_kind_key("tpu", "TPU v6 lite") == "tpu_v6e"
    assert device_kind_key("tpu", "TPU v5 lite") == "tpu_v5e"
    assert device_kind_key("cpu") == "cpu"
    assert {device_kind_key(p, k) for p, k in [("gpu", "h200"), ("tpu", "v6")]} <= set(DEVICE_KINDS)
