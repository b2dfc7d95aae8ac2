"""``kvmem doctor``: every rule firing and not firing on hand-built snapshots, then on real data directories.

The unit tests build :class:`Snapshot` objects directly (the rules are pure
functions). The end-to-end tests make the symptoms for real: a PrefixCache on
a tiny Llama whose chunks come from disk, a corrupted blob, ``kvmem doctor`` run
on the directory.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import kvmem
from kvmem import rows
from kvmem.cli.doctor import Finding, Thresholds, check, diagnose, format_number, render_findings
from kvmem.cli.doctor_snapshot import (
    HistogramSummary,
    KVChunkGroup,
    LiveMetrics,
    Snapshot,
    TierState,
    kv_block_size,
    take_snapshot,
)
from kvmem.cli.main import main
from kvmem.config import Config
from kvmem.kv import PrefixCache
from kvmem.metrics import Metrics
from kvmem.stores.areas import AreaState
from tests.kv.workers import build_model, prompt

GiB = 1024**3
TIERS = (TierState("cpu", 0, 2 * GiB, 0), TierState("disk", 5 * 1024**2, 20 * GiB, 40, persistent=True))


def snap(live: LiveMetrics | None = None, **fields: Any) -> Snapshot:
    """A healthy snapshot of a default config, with ``fields`` replaced (``config`` may be a dict of settings)."""
    settings = fields.pop("config", {})
    assert isinstance(settings, dict)
    config = Config(path="/nonexistent/kvmem", **settings)
    return replace(Snapshot(config=config, tiers=TIERS, entries=40, stored_bytes=5 * 1024**2), live=live, **fields)


def of(findings: list[Finding], area: str) -> list[Finding]:
    return [f for f in findings if f.check == area]


def only(findings: list[Finding], area: str) -> Finding:
    (finding,) = of(findings, area)
    return finding


def test_a_healthy_snapshot_is_all_ok_except_the_live_only_prefetch_note() -> None:
    findings = check(snap())
    assert [(f.check, f.severity) for f in findings] == [
        ("prefetch", "info"),
        ("block_size", "ok"),
        ("pipeline", "ok"),
        ("capacity", "ok"),
        ("integrity", "ok"),
        ("copies", "ok"),
    ]
    assert all(not f.recommendation for f in findings)


# -- (a) prefetch --------------------------------------------------------------------------
def _traffic(chunk_hits: dict[str, int], ttft_mean: float, prefetches: int = 0) -> LiveMetrics:
    return LiveMetrics(
        ttft=HistogramSummary(10, 10 * ttft_mean, 2 * ttft_mean),
        chunk_hits=chunk_hits,
        prefetch=HistogramSummary(prefetches, 0.01 * prefetches, 0.01),
    )


def test_prefetch_warns_on_slow_first_tokens_served_from_disk() -> None:
    f = only(check(snap(_traffic({"disk": 30, "cpu": 10}, ttft_mean=0.8))), "prefetch")
    assert f.severity == "warn" and "disk" in f.title
    assert f.numbers["from_disk_share"] == 0.75 and f.numbers["ttft_mean_s"] == pytest.approx(0.8)
    assert f.numbers["chunk_hits_disk"] == 30
    assert f.recommendation.startswith("prefetch_depth: 3 -> 6") and "PrefixCache.prefetch" in f.recommendation
    with_prefetch = only(
        check(snap(_traffic({"disk": 30}, 0.8, prefetches=5), config={"prefetch_depth": 1})), "prefetch"
    )
    assert with_prefetch.recommendation == "prefetch_depth: 1 -> 3"


@pytest.mark.parametrize(
    "live, severity",
    [
        (_traffic({"cpu": 30, "disk": 10}, ttft_mean=0.8), "ok"),  # mostly from memory
        (_traffic({"disk": 30}, ttft_mean=0.05), "info"),  # from disk, but fast
        (_traffic({"disk": 3}, ttft_mean=0.8), "info"),  # too few hits to judge
    ],
)
def test_prefetch_does_not_warn_without_both_symptoms(live: LiveMetrics, severity: str) -> None:
    f = only(check(snap(live)), "prefetch")
    assert f.severity == severity and not f.recommendation


def test_prefetch_out_of_process_warns_only_when_prefetch_is_off_and_chunks_are_reused() -> None:
    reused = (KVChunkGroup(256, chunks=10, stored_bytes=10_000, reused=4, reused_bytes=4000, hits=9),)
    assert only(check(snap(kv=reused)), "prefetch").severity == "info"
    f = only(check(snap(kv=reused, config={"prefetch_depth": 0})), "prefetch")
    assert f.severity == "warn" and f.numbers["reused_chunks"] == 4
    assert f.recommendation.startswith("prefetch_depth: 0 -> 3")


def guessed(used: int, wasted: int) -> LiveMetrics:
    """Live counters of a process whose predictive prefetch settled ``used`` and ``wasted`` 1 MiB guesses."""
    mib = 1024**2
    return LiveMetrics(
        predictive={"predicted": 2 * (used + wasted), "warmed": used + wasted, "used": used, "wasted": wasted},
        predictive_bytes={"warmed": (used + wasted) * mib, "used": used * mib, "wasted": wasted * mib},
    )


def test_predictive_prefetch_line_says_how_much_of_what_it_moved_was_used() -> None:
    assert of(check(snap(LiveMetrics())), "prefetch")[1:] == []  # off, and nothing guessed: no line
    on = {"predictive_prefetch": True}
    line = of(check(snap(config=on)), "prefetch")[1]
    assert line.severity == "info" and "per process" in line.title
    line = of(check(snap(guessed(1, 1), config=on)), "prefetch")[1]
    assert line.severity == "info" and "too few" in line.title
    line = of(check(snap(guessed(30, 10), config=on)), "prefetch")[1]
    assert line.severity == "ok" and "75.0% of the settled guessed bytes were used" in line.title
    assert line.numbers["wasted_share"] == 0.25 and line.numbers["warmed_bytes"] == 40 * 1024**2
    line = of(check(snap(guessed(10, 30), config=on)), "prefetch")[1]
    assert line.severity == "warn" and line.recommendation == "predictive_prefetch: true -> false"


def test_predictive_prefetch_line_from_a_live_memory(tmp_path: Path) -> None:
    from kvmem.kv import PredictivePrefetcher

    with kvmem.Memory(str(tmp_path / "a"), cpu_bytes="1MiB", fsync="never", predictive_prefetch=True) as first:
        for doc in ("a", "b"):
            first.store(f"{doc}/0", torch.ones(4096), namespace="docs")
    with kvmem.Memory(str(tmp_path / "a"), cpu_bytes="1MiB", fsync="never", predictive_prefetch=True) as memory:
        prefetcher = PredictivePrefetcher(memory)
        for _ in range(4):
            prefetcher.patterns.observe("docs", ["a/0"], "alice")
            prefetcher.patterns.observe("docs", ["b/0"], "alice")
        prefetcher.observe(["a/0"], namespace="docs", stream="bob")
        prefetcher.close()
        assert memory.load("b/0", namespace="docs") is not None
        line = of(diagnose(memory, Thresholds(min_samples=1)), "prefetch")[-1]
        assert line.severity == "ok" and line.numbers["warmed"] == 1 and line.numbers["wasted_share"] == 0.0
        assert 0 < float(line.numbers["cpu_seconds"]) < 60  # the prefetcher's model and copy, not zero
        assert "predictive prefetch" in render_findings([line])


# -- (b) block size ---------------------------------------------------------------------------
def _prompts(n: int, tokens: int, reused: int = 0) -> LiveMetrics:
    return LiveMetrics(
        ttft=HistogramSummary(n, 0.1 * n, 0.1),
        kv_tokens={"requested": n * tokens, "reused": n * reused, "computed": n * (tokens - reused)},
    )


def test_block_size_warns_when_prompts_are_a_chunk_or_two_long() -> None:
    f = only(check(snap(_prompts(20, 300, reused=256))), "block_size")
    assert f.severity == "warn" and f.recommendation == "block_size: 256 -> 32"
    assert f.numbers["prompt_tokens_mean"] == 300 and f.numbers["chunks_per_prompt"] == pytest.approx(1.17)
    assert f.numbers["tail_share"] == pytest.approx(128 / 300)


@pytest.mark.parametrize("live", [_prompts(20, 4128, reused=4096), _prompts(3, 300)])  # many chunks; few prompts
def test_block_size_is_ok_for_long_prompts_or_too_few_of_them(live: LiveMetrics) -> None:
    assert only(check(snap(live)), "block_size").severity == "ok"


def test_block_size_notes_very_fine_chunks() -> None:
    f = only(check(snap(_prompts(10, 16384), config={"block_size": 16})), "block_size")
    assert (f.severity, f.recommendation) == ("info", "block_size: 16 -> 256")


def test_block_size_warns_on_fragmentation_from_the_catalog() -> None:
    fragmented = KVChunkGroup(
        256, chunks=100, stored_bytes=100 * 4096, reused=5, reused_bytes=5 * 4096, hits=40, re_stored=2
    )
    f = only(check(snap(kv=(fragmented,))), "block_size")
    assert f.severity == "warn" and f.recommendation == "block_size: 256 -> 128"
    assert f.numbers["never_reused_share"] == 0.95 and f.numbers["never_reused_bytes"] == 95 * 4096
    assert f.numbers["re_stored"] == 2

    never = only(check(snap(kv=(replace(fragmented, reused=0, reused_bytes=0, hits=0),))), "block_size")
    assert never.severity == "info"
    assert never.recommendation == "if prompts share shorter prefixes: block_size: 256 -> 128"
    for healthy in (replace(fragmented, reused=50), replace(fragmented, chunks=20, reused=1)):  # reused; too few
        assert only(check(snap(kv=(healthy,))), "block_size").severity == "ok"


def test_block_size_points_at_chunks_of_another_block_size() -> None:
    stale = KVChunkGroup(128, chunks=12, stored_bytes=12_000)
    findings = of(check(snap(kv=(stale,))), "block_size")
    assert [f.severity for f in findings] == ["info"]
    assert findings[0].numbers["other_chunks"] == 12
    assert findings[0].recommendation.startswith("block_size: 256 -> 128")
    fragmented = KVChunkGroup(128, chunks=100, stored_bytes=100_000, reused=3, reused_bytes=3000, hits=9)
    warned = of(check(snap(kv=(fragmented,))), "block_size")  # judged at its own block size
    assert [(f.severity, f.recommendation) for f in warned][1] == ("warn", "block_size: 128 -> 64")


def test_kv_block_size_parses_prefix_cache_namespaces_only() -> None:
    assert kv_block_size("kv/" + "ab" * 32 + "/float32/none/256/") == 256
    assert kv_block_size("kv/" + "ab" * 32 + "/bfloat16/int8/64/tenant-a") == 64
    assert kv_block_size("llama") is None and kv_block_size("kv/x/float32/none/big/") is None


# -- (c) pipeline --------------------------------------------------------------------------------
def _stores(p90: float, n: int = 100) -> LiveMetrics:
    return LiveMetrics(store=HistogramSummary(n, n * p90 / 2, p90))


def test_pipeline_warns_on_fsync_always_even_out_of_process() -> None:
    f = only(check(snap(config={"fsync": "always"})), "pipeline")
    assert f.severity == "warn" and f.recommendation.startswith("fsync: always -> batch")


def test_pipeline_warns_on_slow_write_through_and_on_a_full_write_back_queue() -> None:
    through = only(check(snap(_stores(0.05))), "pipeline")
    assert through.severity == "warn" and through.recommendation.startswith("write_policy: through -> back")
    assert through.numbers["store_p90_s"] == 0.05 and "50 ms" in through.title
    back = only(check(snap(_stores(0.05), config={"write_policy": "back"})), "pipeline")
    assert back.severity == "warn" and back.recommendation.startswith("write_back_queue: 64 -> 128")
    assert "queue is full" in back.title


@pytest.mark.parametrize("live", [_stores(0.001), _stores(0.5, n=3), None])  # fast; too few stores; out of process
def test_pipeline_is_ok_without_contention(live: LiveMetrics | None) -> None:
    f = only(check(snap(live)), "pipeline")
    assert f.severity == "ok" and f.numbers["write_policy"] == "through"


# -- (d) capacity -----------------------------------------------------------------------------------
def test_capacity_warns_when_the_reused_set_outgrows_the_cpu_tier() -> None:
    f = only(check(snap(hot_entries=900, hot_bytes=3 * GiB)), "capacity")
    assert f.severity == "warn" and f.numbers["hot_bytes"] == 3 * GiB
    assert f.recommendation == "cpu_bytes: 2GiB -> 6GiB"  # 3 GiB * 1.25 / 0.7, rounded up


def test_capacity_warns_on_a_full_disk_tier() -> None:
    full = (TIERS[0], TierState("disk", 19 * GiB, 20 * GiB, 4000, persistent=True))
    f = only(check(snap(tiers=full)), "capacity")
    assert f.severity == "warn" and "95.0% full" in f.title
    assert f.recommendation.startswith("disk_bytes: 20GiB -> 40GiB")


def test_capacity_warns_on_churn_in_process() -> None:
    churn = LiveMetrics(
        store=HistogramSummary(60, 0.6, 0.01),
        demotions={"cpu": 50},
        evictions={"disk": 5},
        promotions={"cpu": 40},
        ttft=HistogramSummary(10, 12.0, 2.0),
    )
    f = only(check(snap(churn)), "capacity")
    assert f.severity == "warn" and f.numbers["demotions_cpu"] == 50 and f.numbers["evictions_disk"] == 5
    assert f.recommendation == "cpu_bytes: 2GiB -> 4GiB, or offload_threshold: 0.7 -> 0.85"
    calm = replace(churn, demotions={"cpu": 5}, evictions={})
    assert only(check(snap(calm)), "capacity").severity == "ok"


def test_capacity_notes_a_low_offload_threshold_and_is_ok_otherwise() -> None:
    f = only(check(snap(config={"offload_threshold": 0.3})), "capacity")
    assert (f.severity, f.recommendation) == ("info", "offload_threshold: 0.3 -> 0.7")
    ok = only(check(snap(hot_bytes=GiB)), "capacity")
    assert ok.severity == "ok" and set(ok.numbers) == {"hot_bytes", "disk_usage_share"}


# -- (e) integrity ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [
        {"quarantined_rows": 1},
        {"quarantine_files": 2, "quarantine_bytes": 300},
        {"live": LiveMetrics(crc_failures={"disk": 1})},
    ],
)
def test_integrity_warns_on_corruption(fields: dict[str, Any]) -> None:
    f = only(check(snap(**fields)), "integrity")
    assert f.severity == "warn" and "kvmem verify --fix" in f.recommendation


def test_integrity_warns_on_failing_tiers() -> None:
    for fields in (
        {"live": LiveMetrics(tier_errors={"disk": 3})},
        {"tiers": (TIERS[0], replace(TIERS[1], healthy=False))},
    ):
        f = only(check(snap(**fields)), "integrity")
        assert f.severity == "warn" and "disk" in f.title


def test_integrity_warns_on_an_unfinished_migration() -> None:
    f = only(check(snap(disk_areas=AreaState("blobs", 1, "blobs.f2", 2))), "integrity")
    assert f.severity == "warn" and "format 2" in f.title and "kvmem migrate --to-format 2" in f.recommendation
    assert only(check(snap(disk_areas=AreaState("blobs.f2", 2))), "integrity").severity == "ok"


# -- (f) copies ------------------------------------------------------------------------------------------
def test_copies_warn_only_where_streaming_was_possible_but_not_built(tmp_path: Path) -> None:
    f = only(check(snap(copies="not built")), "copies")
    assert f.severity == "warn" and "kvmem._stream" in f.title and "C compiler" in f.recommendation
    assert only(check(snap(copies="no streaming stores")), "copies").severity == "ok"
    with kvmem.Memory(str(tmp_path / "m"), fsync="never") as mem:
        got = take_snapshot(mem).copies
    assert got == ("streaming" if rows.STREAMING else "not built" if rows.STREAMABLE else "no streaming stores")


# -- rendering and the histogram summary -------------------------------------------------------------------
def test_render_findings_shows_units_and_recommendations() -> None:
    text = render_findings(check(snap(_traffic({"disk": 30, "cpu": 10}, 0.8), config={"fsync": "always"})))
    assert "WARN  prefetch" in text and "from_disk_share 75.0%" in text and "ttft_mean_s 800.0 ms" in text
    assert "-> fsync: always -> batch" in text and text.endswith("2 warnings, 0 info, 4 ok")
    assert format_number("x_bytes", 3 * 1024**2) == "3.0 MiB" and format_number("t_s", 2.5) == "2.50 s"


def test_histogram_summary_from_real_metrics(memory: kvmem.Memory) -> None:
    m = memory.metrics
    for seconds in [0.02] * 9 + [3.0]:
        m.ttft_seconds.observe(seconds)
    live = take_snapshot(memory).live
    assert live is not None
    assert live.ttft.count == 10 and live.ttft.mean == pytest.approx(0.318)
    assert live.ttft.p90 == 0.025  # the bucket that holds the 9th of 10 observations
    assert take_snapshot(memory, live=False).live is None
    assert Metrics().registry is not memory.metrics.registry  # each Memory counts on its own


# -- real data directories ----------------------------------------------------------------------------------
@pytest.fixture
def llama(one_thread: None) -> torch.nn.Module:
    return build_model("llama")


def test_diagnose_judges_live_prefix_cache_traffic(tmp_path: Path, llama: torch.nn.Module) -> None:
    """No CPU tier: every chunk comes from disk, so with a zero TTFT bar prefetch is flagged."""
    with kvmem.Memory(str(tmp_path / "d"), cpu_bytes=0, fsync="never") as memory:
        pc = PrefixCache(llama, memory, block_size=16, compression="none")
        ids = prompt(7, 100)  # 6 full chunks
        pc.prefill(ids)
        pc.flush()
        for _ in range(2):
            assert pc.prefill(ids).reused_tokens == 96
        pc.close()
        snapshot = take_snapshot(memory)
        findings = diagnose(memory, Thresholds(slow_ttft_s=0.0))
    assert snapshot.kv == (
        KVChunkGroup(
            16,
            chunks=6,
            stored_bytes=snapshot.kv[0].stored_bytes,
            reused=6,
            reused_bytes=snapshot.kv[0].stored_bytes,
            hits=12,
            re_stored=0,
        ),
    )
    assert snapshot.live is not None and snapshot.live.chunk_hits == {"disk": 12}
    assert snapshot.live.kv_tokens == {"requested": 300, "reused": 192, "computed": 108}
    prefetch = only(findings, "prefetch")
    assert prefetch.severity == "warn" and prefetch.numbers["from_disk_share"] == 1.0
    assert snapshot.hot_entries == 6 and snapshot.entries == 6


def _corrupt_one(path: Path) -> None:
    with kvmem.Memory(str(path), fsync="never") as mem:
        key = mem.store("doc", torch.arange(4096, dtype=torch.float32))
        mem.store("other", b"x" * 1000)
    blob = path / "disk" / "blobs" / key[:2] / f"{key}.kvb"
    raw = bytearray(blob.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    blob.write_bytes(bytes(raw))
    with kvmem.Memory(str(path), fsync="never") as mem:
        assert mem.load("doc") is None  # quarantined by the load


def test_snapshot_sees_quarantine_and_diagnose_counts_crc_failures(tmp_path: Path) -> None:
    path = tmp_path / "d"
    _corrupt_one(path)
    with kvmem.Memory(str(path), fsync="never") as mem:
        s = take_snapshot(mem, live=False)
        assert (s.quarantined_rows, s.quarantine_files, s.entries) == (1, 1, 2)
        assert s.quarantine_bytes > 16_000
        assert only(check(s), "integrity").severity == "warn"


def test_cli_doctor_on_a_clean_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with kvmem.Memory(str(tmp_path / "d"), fsync="never") as mem:
        mem.store("a", b"a" * 100)
        mem.load("a")
    assert main(["doctor", "--path", str(tmp_path / "d")]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"kvmem doctor: {tmp_path / 'd'}: 1 entries (0 KV chunks)")
    assert "OK    integrity" in out and "0 warnings, 1 info, 5 ok" in out


def test_cli_doctor_warns_with_numbers_and_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "d"
    _corrupt_one(path)
    settings = tmp_path / "slow.yaml"
    settings.write_text("fsync: always\nprefetch_depth: 0\n")
    argv = ["doctor", "--path", str(path), "--config", str(settings)]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "WARN  integrity  corrupt entries were found and quarantined" in out
    assert "quarantined_rows 1, quarantine_files 1" in out and "-> run `kvmem verify --fix`" in out
    assert "WARN  pipeline" in out and "-> fsync: always -> batch" in out

    assert main([*argv, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == str(path)
    warned = {f["check"] for f in report["findings"] if f["severity"] == "warn"}
    assert warned == {"integrity", "pipeline"}

    assert main(["verify", "--fix", "--path", str(path)]) == 0
    assert main(["gc", "--path", str(path)]) == 0
    capsys.readouterr()
    assert main(["doctor", "--path", str(path)]) == 0  # repaired; default settings


def test_cli_doctor_on_a_missing_directory_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--path", str(tmp_path / "typo")]) == 2
    assert "no kvmem data directory" in capsys.readouterr().err


def test_a_snapshot_counts_disk_quarantine_files_beside_quarantined_redis_values(
    tmp_path: Path, redis_url: str
) -> None:
    """Redis names its quarantined values (keys, no file): the snapshot counts the disk tier's files only."""
    with kvmem.Memory(tmp_path / "d", cpu_bytes=0, disk_bytes="8MiB", fsync="never", remote_url=redis_url) as mem:
        skeys = [mem.store(f"k{i}", torch.arange(64), namespace=f"doctor-{tmp_path.name}") for i in range(2)]
        disk, redis = (t for t in mem._tiers.tiers if t.name in ("disk", "redis"))
        disk.quarantine(skeys[0])
        redis.quarantine(skeys[1])
        assert len(redis.quarantined()) == 1
        snap = take_snapshot(mem, live=False)
        assert snap.quarantine_files == 1 and snap.quarantine_bytes == disk.quarantined()[0].stat().st_size
        redis.purge_quarantine()
