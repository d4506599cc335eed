"""decode= options on real images: PIL-encoded JPEG/PNG/WEBP files packed by datapipe.pack and
read back through StreamingDataset (in process and in DataLoader workers) and open_dataset;
decode errors are DecodeErrors naming sample, field and decoder, never corruption."""

from __future__ import annotations

import io
import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

import datapipe
from datapipe.decode import IMAGE_SPECS, make_decoder
from datapipe.errors import CorruptShardError, DecodeError
from datapipe.loader import StreamingDataset

N = 12
W, H = 24, 16
FORMATS = ["jpg", "png", "webp"]


def _picture(i: int, mode: str = "RGB") -> Image.Image:
    """A small image with content that differs per sample (gradients, so JPEG keeps them)."""
    x = np.arange(W, dtype=np.uint16)[None, :]
    y = np.arange(H, dtype=np.uint16)[:, None]
    rgb = np.stack([(x * 10 + i * 7) % 256 + 0 * y, (y * 15 + i * 3) % 256 + 0 * x, (x + y + i * 20) % 256],
                   axis=-1).astype(np.uint8)
    return Image.fromarray(rgb, "RGB").convert(mode)


def _encode(img: Image.Image, ext: str) -> bytes:
    buf = io.BytesIO()
    if ext == "jpg":
        img.save(buf, "JPEG", quality=90)
    elif ext == "png":
        img.save(buf, "PNG")
    else:
        img.save(buf, "WEBP", lossless=True)
    return buf.getvalue()


def _images():
    """(key, ext, encoded bytes, the image PIL decodes from those bytes, in RGB)."""
    out = []
    for i in range(N):
        ext = FORMATS[i % 3]
        mode = "L" if i == 3 else ("RGBA" if i == 4 else "RGB")  # a grey JPEG, a PNG with alpha
        data = _encode(_picture(i, mode), ext)
        out.append((f"img/{i:03d}", ext, data, np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))))
    return out


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A directory of image + json + cls files, packed by ``datapipe.pack``."""
    root = tmp_path_factory.mktemp("images")
    src = root / "src"
    (src / "img").mkdir(parents=True)
    images = _images()
    for i, (key, ext, data, _) in enumerate(images):
        (src / f"{key}.{ext}").write_bytes(data)
        (src / f"{key}.json").write_text(json.dumps({"caption": f"picture {i}"}))
        (src / f"{key}.cls").write_text(str(i))
    dest = str(root / "ds")
    datapipe.pack(str(src), dest, shard_samples=5, workers=1)
    return dest, {key: (ext, data, rgb) for key, ext, data, rgb in images}


def _image_field(sample):
    (ext,) = [f for f in FORMATS if f in sample]
    return ext, sample[ext]


def test_default_decode_is_raw_bytes(packed):
    url, images = packed
    for s in StreamingDataset(url, shuffle=False):
        _, value = _image_field(s)
        assert bytes(value) == images[s["__key__"]][1]
        assert bytes(s["cls"]).isdigit() and isinstance(bytes(s["json"]), bytes)
    s = datapipe.open_dataset(url)[0]
    assert isinstance(s["json"], bytes) and s[_image_field(s)[0]] == images[s["__key__"]][1]


@pytest.mark.parametrize("spec", ["pil", "pilrgb"])
def test_pil_gives_loaded_rgb_images_equal_to_what_pil_decodes(packed, spec):
    url, images = packed
    seen = set()
    for s in StreamingDataset(url, decode=spec, seed=1):
        _, img = _image_field(s)
        assert isinstance(img, Image.Image) and img.mode == "RGB" and img.size == (W, H)
        np.testing.assert_array_equal(np.asarray(img), images[s["__key__"]][2])
        assert isinstance(s["json"], bytes) and isinstance(s["cls"], bytes)  # only images decode
        seen.add(s["__key__"])
    assert seen == set(images)


def test_lossless_formats_round_trip_pixel_exact(packed):
    url, _ = packed
    ds = datapipe.open_dataset(url, decode="rgb8")
    for i in range(len(ds)):
        s = ds[i]
        ext, arr = _image_field(s)
        if ext == "jpg" or s["__key__"] == "img/004":  # lossy, or alpha dropped by RGB
            continue
        np.testing.assert_array_equal(arr, np.asarray(_picture(int(s["__key__"][-3:]))))


def test_torch_gives_uint8_chw_rgb_tensors(packed):
    import torch

    url, images = packed
    for s in StreamingDataset(url, decode="torch", shuffle=False):
        ext, t = _image_field(s)
        assert isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and tuple(t.shape) == (3, H, W)
        expect = torch.from_numpy(images[s["__key__"]][2].copy()).permute(2, 0, 1)
        if ext == "jpg":  # torchvision's JPEG decoder may round differently from PIL's
            assert (t.int() - expect.int()).abs().float().mean() < 2
        else:
            assert torch.equal(t, expect)


def test_torch_tensors_batch_through_dataloader_workers(packed):
    import torch

    url, images = packed
    ds = StreamingDataset(url, decode=["torchvision", "cls"], seed=2, map=_image_and_label, batch_size=4)
    loader = datapipe.StreamingDataLoader(ds, batch_size=4, num_workers=2)
    keys = []
    for batch in loader:
        assert batch["cls"].dtype == torch.int64 and batch["image"].dtype == torch.uint8
        assert tuple(batch["image"].shape) == (len(batch["cls"]), 3, H, W)
        keys += batch["__key__"]
        for key, label in zip(batch["__key__"], batch["cls"].tolist()):
            assert int(key[-3:]) == label
    assert sorted(keys) == sorted(images)


def _image_and_label(sample):
    """One field name for every image format, so that the default collate stacks them."""
    return {"__key__": sample["__key__"], "image": _image_field(sample)[1], "cls": sample["cls"]}


def test_lists_combine_names_and_auto_adds_the_basic_types(packed):
    url, _ = packed
    ds = datapipe.open_dataset(url, decode=["pil", "json"])
    s = ds.get("img/002")
    assert isinstance(s["webp"], Image.Image) and s["json"] == {"caption": "picture 2"} and s["cls"] == b"2"
    s = datapipe.open_dataset(url, decode=["pil", "auto"]).get("img/002")
    assert isinstance(s["webp"], Image.Image) and s["cls"] == 2
    s = datapipe.open_dataset(url, decode="auto").get("img/002")
    assert isinstance(s["webp"], bytes) and s["cls"] == 2 and s["json"]["caption"] == "picture 2"
    s = datapipe.open_dataset(url, decode=["cls", {"webp": len}]).get("img/002")
    assert s["webp"] == len(packed[1]["img/002"][1]) and s["json"] == {"caption": "picture 2"}


def test_other_image_modes(packed):
    url, _ = packed
    ds = datapipe.open_dataset(url, decode="pilrgba")
    assert ds.get("img/004")["png"].mode == "RGBA"
    assert datapipe.open_dataset(url, decode="pill").get("img/003")["jpg"].mode == "L"
    assert datapipe.open_dataset(url, decode="l8").get("img/001")["png"].shape == (H, W)


@pytest.mark.parametrize("bad", [["pil", "torch"], "pickle", ["auto", len], 3])
def test_unknown_or_conflicting_decode_options_are_refused(bad):
    with pytest.raises(ValueError, match="decode"):
        make_decoder(bad)


def _png_claiming(width: int, height: int) -> bytes:
    """A valid small PNG whose header (IHDR, with its CRC fixed) claims ``width x height``."""
    data = _encode(_picture(0), "png")
    at = data.index(b"IHDR")
    ihdr = bytearray(data[at : at + 17])
    ihdr[4:12] = struct.pack(">II", width, height)
    crc = struct.pack(">I", zlib.crc32(bytes(ihdr)))
    return data[:at] + bytes(ihdr) + crc + data[at + 21 :]


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # Pillow warns, then we refuse
@pytest.mark.parametrize("side", [10_000, 20_000])  # over the limit; over twice the limit
@pytest.mark.parametrize("spec", ["pil", "torch", "rgb8"])
def test_an_image_over_the_pixel_limit_is_a_decode_error(tmp_path, side, spec):
    assert Image.MAX_IMAGE_PIXELS is not None and side * side > Image.MAX_IMAGE_PIXELS  # Pillow's default holds
    url = str(tmp_path / "bomb")
    with datapipe.ShardWriter(url) as w:
        w.write({"__key__": "ok", "png": _encode(_picture(1), "png")})
        w.write({"__key__": "bomb", "png": _png_claiming(side, side)})
    with pytest.raises(DecodeError, match=rf"sample 'bomb': field 'png' .*'{spec}'") as e:
        list(StreamingDataset(url, shuffle=False, decode=spec))
    assert not isinstance(e.value, CorruptShardError)
    with pytest.raises(DecodeError, match=r"MAX_IMAGE_PIXELS|decompression bomb"):
        datapipe.open_dataset(url, decode=spec).get("bomb")


def test_skip_reports_a_field_that_does_not_decode_not_corruption(tmp_path):
    url = str(tmp_path / "mixed")
    with datapipe.ShardWriter(url) as w:
        for i in range(6):
            w.write({"__key__": f"s{i}", "jpg": _encode(_picture(i), "jpg"), "txt": f"caption {i}"})
        w.write({"__key__": "latin1", "jpg": _encode(_picture(9), "jpg"), "txt": "café".encode("latin-1")})
        w.write({"__key__": "broken", "jpg": b"\xff\xd8 not a jpeg", "txt": "ok"})
    # raw (the default): every sample, the Latin-1 caption as stored
    assert {s["__key__"] for s in StreamingDataset(url, shuffle=False)} == {f"s{i}" for i in range(6)} | {
        "latin1", "broken"}
    with pytest.raises(DecodeError, match=r"sample 'latin1': field 'txt' does not decode with the 'text' decoder"):
        list(StreamingDataset(url, shuffle=False, decode="auto"))
    ds = StreamingDataset(url, shuffle=False, decode=["pil", "txt"], on_error="skip")
    with pytest.warns(RuntimeWarning) as caught:
        got = [s["__key__"] for s in ds]
    assert got == [f"s{i}" for i in range(6)]
    report = str(caught[-1].message)
    assert "does not decode" in report and "corrupt" not in report.lower() and "not damaged" in report
    whys = {key: why for _, key, why in ds.skipped}
    assert set(whys) == {"latin1", "broken"}
    assert "field 'jpg'" in whys["broken"] and "'pil' decoder" in whys["broken"]
    assert "field 'txt'" in whys["latin1"] and "'text' decoder" in whys["latin1"]


@given(data=st.binary(max_size=400), cut=st.integers(0, 400), spec=st.sampled_from(sorted(IMAGE_SPECS)))
@settings(max_examples=120, deadline=None)
def test_damaged_image_bytes_decode_or_raise_decode_error(data, cut, spec):
    """Arbitrary bytes, and real images cut short or with bytes replaced: an image or a
    DecodeError, never another exception."""
    real = _encode(_picture(cut % 7), FORMATS[cut % 3])
    damaged = real[:cut] + data + real[cut + len(data):]
    dec = make_decoder(spec)
    for field_bytes in (data, real[:cut], damaged):
        try:
            dec({"__key__": "k", "png": field_bytes}, "shard.tar")
        except DecodeError as e:
            assert "sample 'k': field 'png'" in str(e)
