"""Health boards and the publisher: FileBoard (local and S3 through moto), StoreBoard over
real torch.distributed stores (TCPStore on loopback, FileStore), reads that never wait for
a rank, atomic replacement, groups, and a publisher that never blocks the trainer."""

import json
import os
import threading
import time
import warnings
from datetime import timedelta

import pytest
import torch.distributed as dist

from datapipe.errors import HealthError, OptionError
from datapipe.health import BOARD_FOLDER, FileBoard, Publisher, StoreBoard, detect
from datapipe.telemetry import Telemetry
from tests.ranks import free_port


def _summary(rank, wait=0.01):
    tel = Telemetry(window_s=None, rank=rank)
    tel.data_wait(wait)
    tel.read("warm", 1 << 20, 0.001)
    doc = tel.close_window().to_dict()
    doc.update(steps=10, step_s=1.0, step_mean_s=0.1)  # steps of a known length (no step() timing)
    return doc


def _until(predicate, what, limit_s=60.0):
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(0.005)


def test_file_board_round_trip_and_groups(tmp_path):
    board = FileBoard(str(tmp_path))
    for r in range(3):
        board.publish(r, _summary(r))
    stage = FileBoard(str(tmp_path), group="stage1")
    stage.publish(7, _summary(7))
    assert sorted(d["rank"] for d in board.read().docs) == [0, 1, 2]  # the group's files are its own
    assert [d["rank"] for d in stage.read().docs] == [7]
    assert [d["rank"] for d in board.read(ranks=[1, 5]).docs] == [1]
    assert sorted(os.listdir(tmp_path / BOARD_FOLDER)) == ["rank-000000.json", "rank-000001.json",
                                                           "rank-000002.json", "stage1"]
    board.publish(1, _summary(1, wait=0.5))  # replaced, not appended
    (doc,) = board.read(ranks=[1]).docs
    assert doc["data_wait_s"] == 0.5


def test_file_board_reads_whole_summaries_while_they_are_replaced(tmp_path):
    board = FileBoard(str(tmp_path))
    docs = [_summary(0, wait=w / 1000) for w in range(1, 50)]
    stop = threading.Event()

    def writer():
        i = 0
        while not stop.is_set():
            board.publish(0, docs[i % len(docs)])
            i += 1

    t = threading.Thread(target=writer)
    t.start()
    try:
        reads = 0
        while reads < 300:
            read = FileBoard(str(tmp_path)).read()
            assert not read.unreadable, read.unreadable  # never a partial file
            reads += len(read.docs)
    finally:
        stop.set()
        t.join()
    board.close()
    assert [n for n in os.listdir(tmp_path / BOARD_FOLDER) if n.startswith(".tmp-")] == []


def test_file_board_names_what_is_not_a_summary(tmp_path):
    board = FileBoard(str(tmp_path))
    board.publish(0, _summary(0))
    folder = tmp_path / BOARD_FOLDER
    (folder / "rank-000001.json").write_bytes(b"\x00garbage")
    (folder / "rank-000002.json").write_text(json.dumps(_summary(5)))  # another rank's summary
    (folder / "rank-000003.json").write_bytes(b" " * (2 << 20))
    (folder / "notes.txt").write_text("not a board file")  # ignored
    read = board.read()
    assert [d["rank"] for d in read.docs] == [0]
    reasons = dict(read.unreadable)
    assert "not JSON" in reasons[1] and "holds the summary of rank 5, not of rank 2" in reasons[2]
    assert "more than a window summary may be" in reasons[3]
    report = detect(read.docs, unreadable=read.unreadable)
    assert sorted(report.named("unreadable")) == [1, 2, 3]


def test_file_board_on_s3(s3):
    root, opts = s3
    board = FileBoard(f"{root}/run", storage_options=opts)
    for r in range(3):
        board.publish(r, _summary(r))
    read = FileBoard(f"{root}/run", storage_options=opts).read()
    assert sorted(d["rank"] for d in read.docs) == [0, 1, 2] and not read.unreadable


def test_store_board_over_a_tcpstore_never_waits_for_a_missing_rank():
    port = free_port()
    # a short store timeout: a get() of a key nobody set would raise after it, a read must not
    master = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=2))
    client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=2))
    board = StoreBoard(client, group="pp0", world_size=4)
    board.publish(0, _summary(0))
    board.publish(2, _summary(2))
    read = StoreBoard(master, group="pp0", world_size=4).read()
    assert sorted(d["rank"] for d in read.docs) == [0, 2] and not read.unreadable
    assert StoreBoard(master, group="pp1", world_size=4).read().docs == []  # another group's keys
    report = detect(read, ranks=range(4))
    assert sorted(report.named("missing")) == [1, 3]
    master.set("datapipe/health/pp0/rank-1", b"{not json")
    read = board.read()
    assert [r for r, _ in read.unreadable] == [1]


def test_store_board_over_a_filestore(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    prefixed = dist.PrefixStore("job7", store)
    StoreBoard(prefixed).publish(0, _summary(0))
    assert [d["rank"] for d in StoreBoard(prefixed, world_size=2).read().docs] == [0]


def test_store_board_needs_a_store():
    with pytest.raises(OptionError, match=r"expected a torch\.distributed Store"):
        StoreBoard({"not": "a store"})
    with pytest.raises(OptionError, match="group="):
        StoreBoard(dist.HashStore(), group="a/b")


def test_a_store_that_went_away_is_a_health_error():
    port = free_port()
    master = dist.TCPStore("127.0.0.1", port, 1, is_master=True, timeout=timedelta(seconds=2))
    client = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=timedelta(seconds=2))
    board = StoreBoard(client, world_size=1)
    del master  # the server is gone
    with pytest.raises(HealthError, match="cannot read datapipe/health/rank-0"):
        board.read()


def test_publisher_publishes_each_window_from_its_thread(tmp_path):
    tel = Telemetry(window_s=None, window_steps=3, rank=4)
    board = FileBoard(str(tmp_path))
    pub = Publisher(tel, board)
    tel.step()
    for w in (1, 2):
        for _ in range(3):
            tel.step()
        _until(lambda: tel.windows >= w, f"window {w}")  # noqa: B023
    assert pub.flush(30)
    assert pub.published >= 2 and pub.last_seq >= 2 and pub.errors == 0 and pub.publish_seconds > 0
    (doc,) = board.read().docs
    assert doc["rank"] == 4 and doc["seq"] == pub.last_seq
    pub.close()
    tel.close()


class _StuckBoard:
    """A board whose publish hangs until released (a dead NFS server)."""

    def __init__(self):
        self.release = threading.Event()
        self.calls = 0

    def publish(self, rank, doc):
        self.calls += 1
        self.release.wait(60)

    def read(self, ranks=None):
        return []


def test_a_stuck_board_never_blocks_the_trainer_or_the_windows(tmp_path):
    tel = Telemetry(window_s=None, metrics_path=tmp_path / "m.jsonl", rank=0)
    board = _StuckBoard()
    pub = Publisher(tel, board)
    tel.close_window()
    _until(lambda: board.calls == 1, "the first publish to start")
    for _ in range(5):  # windows go on closing (and reach the metrics file) while the board hangs
        tel.data_wait(0.001)
        tel.close_window()
    assert tel.windows == 6 and len((tmp_path / "m.jsonl").read_text().splitlines()) == 6
    assert not pub.flush(0.01)
    board.release.set()
    assert pub.flush(30)
    assert board.calls == 2  # the hung one, then only the newest of the five waiting: none queued up
    pub.close()


class _BrokenBoard:
    def publish(self, rank, doc):
        raise OSError(28, "No space left on device")

    def read(self, ranks=None):
        return []


def test_a_failing_board_warns_once_and_training_goes_on():
    tel = Telemetry(window_s=None, rank=0)
    pub = Publisher(tel, _BrokenBoard())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            tel.close_window()
            assert pub.flush(30)
    assert pub.errors == 3 and pub.published == 0
    assert len([w for w in caught if "could not publish its window summary" in str(w.message)]) == 1
    pub.close()


def test_publisher_rank_comes_from_the_job_when_not_given(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    tel = Telemetry(window_s=None)
    pub = Publisher(tel, FileBoard(str(tmp_path)))
    assert pub.rank == 5
    tel.close_window()
    assert pub.flush(30)
    assert [d["rank"] for d in FileBoard(str(tmp_path)).read().docs] == [5]
    pub.close()
    with pytest.raises(OptionError, match="telemetry="):
        Publisher("tel", FileBoard(str(tmp_path)))
    with pytest.raises(OptionError, match="board="):
        Publisher(tel, object())


def test_status_without_a_board_says_so(tmp_path, capsys):
    from datapipe.cli import main

    assert main(["status", str(tmp_path / "nowhere")]) == 2
    assert "no run directory at" in capsys.readouterr().err
    assert main(["status", str(tmp_path)]) == 2
    assert "no window summary under" in capsys.readouterr().err
    board = FileBoard(str(tmp_path))
    for r in range(3):
        board.publish(r, _summary(r))
    assert main(["status", str(tmp_path), "--stale-s", "3600"]) == 0
    assert "3 rank(s) compared" in capsys.readouterr().out
    assert main(["status", str(tmp_path), "--ranks", "0-3"]) == 1  # rank 3 is missing
    assert "rank 3: missing" in capsys.readouterr().out
    assert main(["status", str(tmp_path), "-k", "1"]) == 2  # k must exceed 1
    assert "k=1" in capsys.readouterr().err
