"""One canonical JSON for every self-checksummed document (dataset manifest, token manifest,
checkpoint part and manifest), and one envelope (format, version, manifest_checksum) for the
two manifests: the bytes each writer stores and what each reader says about a damaged one."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from datapipe.checkpoint.format import decode_doc, encode_doc
from datapipe.checksum import canonical_json, checksum
from datapipe.errors import CorruptIndexError, FormatError
from datapipe.format import SAMPLES_FILE, SHARDS_FILE, digest_bytes, make_manifest, parse_manifest
from datapipe.format.tokens import TokenPart, make_token_manifest, parse_token_manifest

JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)
EXTRA = st.dictionaries(st.text(min_size=1, max_size=6).map(lambda k: "x_" + k), JSON, max_size=4)


def _spelled(doc: dict, omit: str | None) -> bytes:
    """The canonical form as docs/FORMAT.md and docs/CHECKPOINT_FORMAT.md spell it."""
    rest = {k: v for k, v in doc.items() if k != omit}
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _part() -> TokenPart:
    return TokenPart("part-00000-000", "part-00000-000.idx", "part-00000-000.xxh", 8, 58, 1, 1, 4,
                     "xxh3_64:" + "0" * 16, "xxh3_64:" + "1" * 16)


@given(EXTRA)
def test_every_writer_checksums_the_same_canonical_form(extra):
    assert canonical_json(extra) == _spelled(extra, None)
    assert canonical_json({**extra, "manifest_checksum": "x"}, omit="manifest_checksum") == _spelled(extra, None)
    for data in (make_manifest([], "none", ["txt"], extra=extra),
                 make_token_manifest([_part()], dtype="uint16", vocab_size=100, eos_id=0, extra=extra)):
        doc = json.loads(data)
        assert data == json.dumps(doc, indent=1, sort_keys=True).encode() + b"\n"
        assert doc["manifest_checksum"] == checksum(_spelled(doc, "manifest_checksum"))
    doc = json.loads(encode_doc({"step": 1, **extra}, "part"))
    assert doc["checksum"] == checksum(_spelled(doc, "checksum"))
    assert decode_doc(encode_doc({"step": 1, **extra}, "part"), "part", "w")["step"] == 1


def test_a_dataset_manifest_keeps_nan_readable_and_a_token_manifest_refuses_it():
    files = {SHARDS_FILE: digest_bytes(b"shards"), SAMPLES_FILE: digest_bytes(b"samples")}
    data = make_manifest([], "none", ["txt"], extra={"x_note": float("nan")}, index_files=files)
    assert b"NaN" in data
    assert math.isnan(parse_manifest(data, "ds")["x_note"])
    with pytest.raises(ValueError):
        canonical_json({"x": float("nan")})
    token = make_token_manifest([_part()], dtype="uint16", vocab_size=100, eos_id=0).replace(
        b'"eos_id": 0', b'"eos_id": NaN')
    with pytest.raises(CorruptIndexError, match=r"^tok: manifest checksum mismatch \(the manifest was damaged or "
                                                 r"edited\); re-run the pack that wrote it$"):
        parse_token_manifest(token, "tok")


@pytest.mark.parametrize("parse,good,what,remedy,reads", [
    (parse_manifest, lambda: make_manifest([], "none", ["txt"]), "dataset", "re-run the pack or join that wrote it",
     "versions 1, 2"),
    (parse_token_manifest, lambda: make_token_manifest([_part()], dtype="uint16", vocab_size=100, eos_id=0), "token",
     "re-run the pack that wrote it", "version 1"),
], ids=["dataset", "token"])
def test_the_envelope_errors_of_both_manifests(parse, good, what, remedy, reads):
    data = good()
    doc = json.loads(data)
    with pytest.raises(CorruptIndexError, match=r"^m: manifest is not JSON: "):
        parse(data[:-9], "m")
    with pytest.raises(FormatError, match=rf"^m: not a datapipe {what} manifest \(format != "):
        parse(json.dumps({**doc, "format": "other"}).encode(), "m")
    with pytest.raises(FormatError, match=rf"^m: {what} format version 99; this datapipe reads {reads} "
                                          r"\(upgrade datapipe\)$"):
        parse(json.dumps({**doc, "version": 99}).encode(), "m")
    for damaged in ({**doc, "x_added": 1}, {**doc, "manifest_checksum": 7}, {**doc, "x_big": 1e999}):
        with pytest.raises(CorruptIndexError, match=r"^m: manifest checksum mismatch \(the manifest was damaged "
                                                    rf"or edited\); {remedy}$"):
            parse(json.dumps(damaged).encode().replace(b"1e+999", b"1e999").replace(b"Infinity", b"1e999"), "m")
