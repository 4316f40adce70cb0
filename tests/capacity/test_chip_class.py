"""The chip class keys learned rates: CPU, CUDA and Apple boxes must never share one."""
import platform

import mlx.core as mx

from capacity.identity import normalize_chip_class
from serve_app.heartbeat import chip_class


def test_this_cpu_box_reports_its_platform():
    got = chip_class()
    assert got == f"{platform.system().lower()}-{platform.machine()}"
    assert normalize_chip_class(got) == got


def test_a_cuda_box_gets_its_own_class(monkeypatch):
    # Fake: this machine has no GPU, so MLX's device answers are replaced for this one test.
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "NVIDIA H200 NVL"})
    assert chip_class() == "cuda|NVIDIA|H200|NVL"
    monkeypatch.setattr(mx, "device_info",
                        lambda: {"device_name": "Vendor(R) GPU: " + "x" * 100})
    odd = chip_class()
    assert odd.startswith("cuda|VendorR|GPU|") and len(odd) == 64
    assert normalize_chip_class(odd) == odd


def test_apple_silicon_keeps_the_chip_name(monkeypatch):
    # Fake, as above: the Apple path needs a Mac.
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(mx, "device_info", lambda: {"device_name": "Apple M3 Max"})
    assert chip_class() == "M3|Max"
