"""Issue 42, rows 1-3 and 13 without a server: the bounded GGUF header reader (webchat.gguf.header) against header
bombs and broken files, each refused at once in one line that says what is wrong; the catalog leaves such entries
out, one log line each; real files read as gguf's own GGUFReader reads them."""

from __future__ import annotations

import logging
import os
import re
import resource
import struct
import time
from pathlib import Path

import gguf
import pytest
from gguf_bombs import array_bomb, many_strings  # tests/ is on sys.path under pytest

from bench.tiny import make_tiny_model
from webchat.gguf.convert import ConversionError, convert_gguf
from webchat.serve.models import scan

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gguf_write import write_gguf

    root = tmp_path_factory.mktemp("good")
    make_tiny_model(root / "tiny", seed=3, max_seq_len=256)
    write_gguf(root / "tiny", root / "tiny.gguf", "llama")
    return root / "tiny.gguf"


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_133_byte_file_declaring_2_to_the_60_items_is_refused_at_once(tmp_path: Path) -> None:
    """Row 1: gguf's reader walks the array item by item past the file's end (75 MB/s); this one never starts."""
    from webchat.gguf.header import GGUFError, read_header

    bomb = array_bomb(tmp_path / "bomb.gguf")
    assert bomb.stat().st_size == 133
    t0, peak = time.monotonic(), rss_mb()
    with pytest.raises(GGUFError) as err:
        read_header(bomb)
    assert time.monotonic() - t0 < 0.5 and rss_mb() - peak < 50
    assert str(err.value) == ("bomb.gguf: key 'general.architecture' declares an array of 1152921504606846976 uint8 "
                              "items, which needs at least 1152921504606846976 bytes; only 65 bytes are left in the "
                              "file")
    with pytest.raises(GGUFError, match="declares an array of 1152921504606846976 string items, which needs at least "
                                        "9223372036854775808 bytes"):
        read_header(array_bomb(tmp_path / "strings.gguf", item=8))


def test_two_million_empty_strings_are_refused_by_count(tmp_path: Path) -> None:
    """Row 2: 16 MB of string lengths (gguf's reader: ~800 bytes and 20 µs each)."""
    from webchat.gguf.header import GGUFError, read_header

    path = many_strings(tmp_path / "strings.gguf")
    t0, peak = time.monotonic(), rss_mb()
    with pytest.raises(GGUFError, match=r"^strings.gguf: its metadata holds more than 1048576 strings in arrays "
                                        r"\(2000000 in 'tokenizer.ggml.tokens'\)"):
        read_header(path)
    assert time.monotonic() - t0 < 0.5 and rss_mb() - peak < 50


@pytest.mark.parametrize(("name", "data", "words"), [
    ("empty", b"", "0 bytes long, too short for a GGUF header"),
    ("zip", b"PK\x03\x04" + b"\0" * 60, "not a GGUF file (it starts with b'PK\\x03\\x04'"),
    ("v9", b"GGUF" + struct.pack("<IQQ", 9, 0, 0), "GGUF version 9 is not one webchat reads (2 or 3)"),
    ("keys", b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 40), "declares 1099511627776 metadata keys, which need at least"),
    ("tensors", b"GGUF" + struct.pack("<IQQ", 3, 1 << 40, 0), "declares 1099511627776 tensors; at most 65536"),
    ("type", b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 77)
     + b"\0" * 16, "key 'k' has value type 77, which is not a GGUF type (0 to 12)"),
    ("cut", b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1000) + b"abc" + b"\0" * 20,
     "the name of metadata key 0 needs 1000 bytes at byte 32, but the file ends 23 bytes later"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 10 else "")
def test_broken_headers_are_one_line_saying_what_is_wrong(tmp_path: Path, name: str, data: bytes, words: str) -> None:
    from webchat.gguf.header import GGUFError, read_header

    path = tmp_path / f"{name}.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError) as err:
        read_header(path)
    assert str(err.value).startswith(f"{name}.gguf: ") and words in str(err.value) and "\n" not in str(err.value)


def test_a_truncated_file_is_named_in_words_by_the_catalog_and_the_converter(good_gguf: Path, tmp_path: Path,
                                                                            caplog: pytest.LogCaptureFixture) -> None:
    """Row 13: the catalog logged `ValueError: cannot reshape array of size ...` (gguf's reader), the file named and
    its problem not; now the tensor and the truncation are named, before gguf's reader is used."""
    shelf = tmp_path / "models"
    shelf.mkdir()
    make_tiny_model(shelf / "tiny-a", seed=0, max_seq_len=256)
    cut = shelf / "cut.gguf"
    cut.write_bytes(good_gguf.read_bytes()[:-100])
    caplog.set_level(logging.INFO, "webchat.serve.models")
    assert list(scan(shelf / "tiny-a", shelf)) == ["tiny-a"]
    words = r"cut.gguf: tensor '[\w.]+' needs bytes \d+ to \d+, but the file ends at byte \d+: the file is truncated$"
    [line] = [r.getMessage() for r in caplog.records if "cut.gguf left out" in r.getMessage()]
    assert re.search(words, line), line
    with pytest.raises(ConversionError, match="^" + words):
        convert_gguf(cut, tmp_path / "out")
    with pytest.raises(ConversionError, match="^bomb.gguf: key 'general.architecture' declares an array"):
        convert_gguf(array_bomb(tmp_path / "bomb.gguf"), tmp_path / "out2")


def test_a_real_file_reads_as_ggufs_own_reader_reads_it(good_gguf: Path) -> None:
    from webchat.gguf.header import keep_none, read_header

    header, reader = read_header(good_gguf, keep=lambda key, n: True), gguf.GGUFReader(good_gguf)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert header.metadata.keys() == fields.keys()
    for key, value in fields.items():
        assert header.metadata[key] == pytest.approx(value), key
    assert [(t.name, t.shape, t.ggml_type, t.offset, t.nbytes) for t in header.tensors] == [
        (t.name, tuple(int(n) for n in t.shape), int(t.tensor_type), t.data_offset, t.n_bytes)
        for t in reader.tensors]
    skipped = read_header(good_gguf, keep=keep_none).metadata["tokenizer.ggml.tokens"]
    assert skipped.item_type == "string" and skipped.count == len(fields["tokenizer.ggml.tokens"])


def test_the_catalog_leaves_bad_entries_out_one_line_each(good_gguf: Path, tmp_path: Path,
                                                         caplog: pytest.LogCaptureFixture) -> None:
    """Rows 1-3: a header bomb, two million strings, a symbolic link loop, a FIFO and an unreadable file beside a
    good model: the good one is listed, each bad one named once with what is wrong."""
    shelf = tmp_path / "models"
    shelf.mkdir()
    make_tiny_model(shelf / "tiny-a", seed=0, max_seq_len=256)
    os.link(good_gguf, shelf / "good.gguf")
    array_bomb(shelf / "bomb.gguf")
    many_strings(shelf / "strings.gguf")
    os.symlink("loop.gguf", shelf / "loop.gguf")
    os.mkfifo(shelf / "fifo.gguf")
    locked = array_bomb(shelf / "locked.gguf")
    locked.chmod(0)
    caplog.set_level(logging.INFO, "webchat.serve.models")
    t0 = time.monotonic()
    cards = scan(shelf / "tiny-a", shelf)
    assert time.monotonic() - t0 < 5
    assert list(cards) == ["tiny-a", "good"] and cards["good"].architecture == "llama"
    lines = [r.getMessage() for r in caplog.records]
    expected = {"bomb.gguf": "declares an array of 1152921504606846976 uint8 items",
                "strings.gguf": "holds more than 1048576 strings", "loop.gguf": "a symbolic link loop",
                "fifo.gguf": "not a regular file",
                "locked.gguf": "permission denied" if os.geteuid() else "declares an array"}  # root reads anything
    for name, words in expected.items():
        mine = [line for line in lines if f"/{name} left out: " in line]
        assert len(mine) == 1 and words in mine[0], (name, lines)
    assert len(lines) == len(expected)


def test_an_entry_that_hangs_is_left_out_at_its_deadline() -> None:
    """A describe stuck on a hung disk (here: a sleep) costs its deadline, not the start-up."""
    from webchat.serve.catalog import describe, describe_all

    slow, fast = Path("slow.gguf"), Path("fast")

    def describe_one(path: Path) -> object:
        if path == slow:
            time.sleep(30)
        return describe(Path("/nonexistent")) if path != fast else "fast"

    t0 = time.monotonic()
    out = describe_all([slow, fast], timeout=0.5, describe_one=describe_one)  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 3
    assert out == ["describing it took more than 0.5 s", "fast"]
