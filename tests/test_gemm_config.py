"""GEMM configuration choice on the CPU: the registry and its build keys, the heuristic's decisions on
representative shard shapes, forced overrides, and the tuning cache (keys, invalid and stale files rejected with a
clear message, concurrent writers)."""
from __future__ import annotations

import dataclasses
import json
import multiprocessing
import warnings

import pytest

from flux_shmem.errors import BuildError, FluxShmemError
from flux_shmem.kernels import build as kb
from flux_shmem.kernels import config, plain, registry, tune_cache
from flux_shmem.kernels.tune_cache import DeviceKey, Entry, TuneCacheError

H200 = DeviceKey("NVIDIA H200", 132, "13.0")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch, tmp_path):
    for var in (config.ENV_FORCE, plain.ENV_TUNE):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv(tune_cache.ENV_PATH, str(tmp_path / "gemm_tune.json"))


# --- registry and build keys ---------------------------------------------------------------------------------------

def test_registry_entries():
    assert registry.DEFAULT in registry.CONFIGS
    names = registry.names()
    assert len(set(names)) == len(names) >= 4
    kinds = {(c.tile_m, c.tile_n, c.schedule) for c in registry.CONFIGS.values()}
    assert (128, 128, "cooperative") in kinds and (128, 128, "pingpong") in kinds and (128, 256, "cooperative") in kinds
    for c in registry.CONFIGS.values():
        assert c.max_splits == (1 if c.pingpong else registry.MAX_SPLITS)
        assert f"FS_GEMM_PINGPONG={int(c.pingpong)}" in c.defines and len(c.defines) == 5
    assert registry.get(None).name == registry.DEFAULT
    with pytest.raises(FluxShmemError, match="unknown GEMM kernel configuration 'nope': one of"):
        registry.get("nope")
    with pytest.raises(ValueError, match="schedule"):
        registry.KernelConfig("x", 128, 128, 1, 1, "stream-k")


def test_registry_fingerprint_tracks_entries(monkeypatch):
    fp = registry.fingerprint()
    changed = dict(registry.CONFIGS)
    changed[registry.DEFAULT] = dataclasses.replace(changed[registry.DEFAULT], cluster_m=1)
    monkeypatch.setattr(registry, "CONFIGS", changed)
    assert registry.fingerprint() != fp
    monkeypatch.undo()
    monkeypatch.setattr(registry, "SPLIT_SCHEDULE", "another meaning of split")
    assert registry.fingerprint() != fp  # a tuned split=2 measured under another schedule is stale


def test_build_keys_per_config():
    keys = {kb.cache_key("gemm_rs", "90a", c) for c in registry.names()}
    assert len(keys) == len(registry.names())
    assert kb.cache_key("gemm_rs", "90a") == kb.cache_key("gemm_rs", "90a", registry.DEFAULT)
    assert all(registry.get(c).name in kb.cache_key("ag_gemm", "90a", c) for c in registry.names())
    # GEMM cubins do not link NVSHMEM: their key does not depend on its version, the collectives' does
    assert "nvshmem" not in kb.cache_key("gemm_rs", "90a") and "nvshmem" in kb.cache_key("collectives", "90a")
    assert kb.gemm_families() == ["ag_gemm", "gemm_rs"]
    with pytest.raises(BuildError, match="unknown GEMM kernel configuration"):
        kb.cache_key("gemm_rs", "90a", "nope")
    with pytest.raises(BuildError, match="has no kernel configurations"):
        kb.cache_key("collectives", "90a", registry.DEFAULT)


def test_build_cli_lists_configs(capsys):
    from flux_shmem import build as cli
    assert cli.main(["--list", "--family", "gemm_rs", "--config", "all"]) == 0
    out = capsys.readouterr().out
    assert all(f"gemm_rs [{c}]" in out for c in registry.names())
    assert cli.main(["--list", "--family", "gemm_rs", "--config", "nope"]) == 1


# --- the model and the heuristic -----------------------------------------------------------------------------------

def test_persistent_clusters_follow_cutlass_rule():
    two = registry.get("128x256_c2x1")
    assert config.persistent_clusters(two, 132) == 66
    assert config.persistent_clusters(two, 124) == 62
    assert config.persistent_clusters(two, 66) == 33
    assert config.persistent_clusters(two, 17) == 8
    assert config.persistent_clusters(registry.get("256x128_c1x2"), 132) == 66


def test_heuristic_splits_the_partial_last_wave():
    """Stream-K for a partial last wave where its tail is compute-bound: 1024x4608x12288 is 72 cluster tiles of
    128x256 on 66 clusters (1.09 waves; on the H100 2026-12-06 stream-K ran 206 us, whole tiles would be ~305).
    Under one wave every tile is cut into pieces."""
    c = config.heuristic(1024, 4608, 12288, "bf16", "nk", 132)
    assert c.config == "128x256_c2x1" and c.split == 2 and c.source == "heuristic"
    assert "1.09 waves" in c.reason and "last 72 as stream-K over 66 clusters" in c.reason
    tiny = config.heuristic(1024, 1280, 8192, "bf16", "kn", 132)  # under one wave: every tile in pieces
    assert tiny.split >= 2 and "as stream-K over" in tiny.reason


def test_stream_k_tail_pays_its_dram_traffic():
    """The stream-K tail's clusters run at different K offsets and share little in L2: its operand bytes cross DRAM
    about once per tile. Measured on the H100 (2026-12-06, tp-shard part 1/4): 4096x1280x8192 as stream-K 205 us,
    its whole-tile plan modelled at 204; 1024x7392x8192 276-291 us, against 208 modelled whole. The model now
    charges those bytes (with 128x256 tiles on 132 SMs the tail is DRAM-bound, 1.3x its compute), so stream-K no
    longer runs where it measured slower than whole tiles would be."""
    cfg = registry.get("128x256_c2x1")
    for m, n, k in ((1024, 7392, 8192), (2048, 3584, 8192), (4096, 1792, 4096), (1024, 6656, 16384)):
        sk, whole = config.estimate(cfg, m, n, k, 132, 2), config.estimate(cfg, m, n, k, 132, 1)  # unaligned
        assert sk.us > whole.us / (1 + config.MARGIN), (m, n, k, sk.us, whole.us)
        assert config.heuristic(m, n, k, "bf16", "nk", 132).split == 1, (m, n, k)
    e = config.estimate(cfg, 4096, 1280, 8192, 132, 2)  # 80 tiles x (256 + 256) x 8192 x 2 B = 671 MB
    assert e.us >= config.STREAMK_DRAM_SHARE * 80 * 512 * 8192 * 2 / (config.DRAM_GBPS * 1e3)
    # fp8 operands are half the bytes
    assert config.estimate(cfg, 4096, 1280, 8192, 132, 2, dtype="e4m3").us < e.us


def test_aligned_stream_k_model():
    """Aligned ranges (chunks q, csrc/include/flux_shmem/gemm_schedule.cuh) put the tail's clusters at q K offsets,
    so the model charges q waves' worth of A and B bytes instead of every tile's own, and their longest range: on
    4096x1280x8192 (80 tiles, 66 clusters) q = 4 gives ranges of 128 or 160 K-tiles (unaligned: 155-156) and about
    4 x 1.2 waves x 14 cluster rows + 5 cluster columns of bytes, below the 671 MB the unaligned tail moves. The
    heuristic keeps q = 0 until a GPU measures it (HEURISTIC_CHUNKS); the tuner offers both."""
    from flux_shmem.kernels import tune
    cfg = registry.get("128x256_c2x1")
    assert config.tail_ranges(80, 66, 128, 4)[:3] == [(0, 128), (128, 288), (288, 448)]
    assert max(b - a for a, b in config.tail_ranges(80, 66, 128, 0)) == 156
    assert config.tail_chunks(128, 0) == config.tail_chunks(128, 200) == 128 and config.tail_chunks(128, 4) == 4
    assert config.tail_plan(2, 66, 16, 3, 2) == (0, 4)  # ranges never fewer chunks than one
    e0 = config.estimate(cfg, 4096, 1280, 8192, 132, 2)
    e4 = config.estimate(cfg, 4096, 1280, 8192, 132, 2, chunks=4)
    best = config.estimate(cfg, 4096, 1280, 8192, 132, 2, chunks=None)
    assert e0.chunks == 0 and e4.chunks == 4 and best.chunks in config.CHUNK_OPTIONS and best.us <= e4.us < e0.us
    assert "at 4 K offsets" in e4.summary()
    assert config.estimate(cfg, 4096, 1280, 8192, 132, 1, chunks=4).chunks == 0  # no tail, nothing to align
    assert config.heuristic(4096, 1280, 8192, "bf16", "nk", 132).chunks == config.HEURISTIC_CHUNKS == 0
    cands = tune.tune_candidates(4096, 1280, 8192, 132, max_candidates=12)
    aligned = [c for c in cands if c.chunks]
    assert aligned and any(c.chunks == 0 and c.split > 1 and c.reason == "unaligned stream-K" for c in cands)
    assert all(tune.label(c).endswith(f"/q{c.chunks}") for c in aligned)
    with pytest.raises(FluxShmemError, match="chunks"):
        config.estimate(cfg, 4096, 1280, 8192, 132, 2, chunks=-1)


def test_forced_chunks(monkeypatch):
    monkeypatch.setenv(config.ENV_FORCE, "config=128x256_c2x1,split=2,chunks=4")
    c = config.choose(4096, 1280, 8192, "bf16", "nk", 132, use_cache=False)
    assert (c.config, c.split, c.chunks, c.source) == ("128x256_c2x1", 2, 4, "forced")
    assert "chunks=4" in c.describe()
    monkeypatch.setenv(config.ENV_FORCE, "split=2")
    assert config.choose(4096, 1280, 8192, "bf16", "nk", 132, use_cache=False).chunks == 0
    monkeypatch.setenv(config.ENV_FORCE, "chunks=x")
    with pytest.raises(FluxShmemError, match="chunks must be an integer"):
        config.forced()


def test_heuristic_keeps_default_on_full_waves():
    """Full waves keep the default tile and no split; the swizzle group narrows with N as measured (issue 11: sw1
    at N = 3584, sw4 at 7168, sw8 from 8192)."""
    for (m, n, k), swz in (((16384, 3584, 8192), 1), ((8192, 7168, 8192), 4), ((8192, 8192, 8192), 8),
                           ((16384, 28672, 8192), 8)):
        c = config.heuristic(m, n, k, "bf16", "nk", 132)
        assert (c.config, c.swizzle, c.split) == (registry.DEFAULT, swz, 1), (m, n, k, c.describe())
    assert [config.swizzle_cap_for_n(n) for n in (None, 1280, 4096, 4608, 7168, 8192)] == [8, 1, 1, 4, 4, 8]


def test_heuristic_follows_the_sm_count():
    """The same shape on fewer SMs (MPS share, SMs left to communication): other waves, other decisions."""
    full = config.candidates(8192, 1280, 8192, 132)
    half = config.candidates(8192, 1280, 8192, 66)
    assert full[0].clusters == 66 and half[0].clusters == 33
    assert config.heuristic(8192, 1280, 8192, "bf16", "nk", 124).split >= 1
    est = config.estimate(registry.get(registry.DEFAULT), 8192, 1280, 8192, 66)
    assert est.waves == pytest.approx(160 / 33)


def test_group_rows_caps_the_swizzle():
    cfg = registry.get("128x256_c2x1")  # one cluster = 256 rows
    assert config.swizzle_for(cfg, 8192)[0] == 8
    assert config.swizzle_for(cfg, 8192, group_rows=1024)[0] == 4
    assert config.swizzle_for(cfg, 8192, group_rows=256)[0] == 1
    s, note = config.swizzle_for(cfg, 8192, group_rows=128)
    assert s == 1 and "exceeds group_rows=128" in note
    assert config.swizzle_for(cfg, 512)[0] == 2  # two clusters along M
    c = config.choose(8192, 8192, 8192, "bf16", "nk", 132, group_rows=512, use_cache=False)
    assert c.swizzle * 256 <= 512
    with pytest.raises(FluxShmemError, match="group_rows"):
        config.swizzle_for(cfg, 8192, group_rows=0)


def test_stream_k_model_follows_the_kernels_plan():
    """tail_plan is the kernel's plan (tests/test_gemm_schedule.py checks that one); the model's time of a stream-K
    tail is the larger of the even share of its K-tiles and its operands' DRAM time, plus the pieces' reduction:
    8192x1280x8192 (2.42 waves) would cost 2.42 tile times from compute alone, but its DRAM-bound tail of 1.42
    waves costs ~1.3x that (measured on the H100: 287-293 us, whole tiles modelled ~300)."""
    assert config.tail_plan(160, 66, 1, 128) == (160, 0)
    assert config.tail_plan(132, 66, 2, 128) == (132, 0)  # whole waves: nothing to split
    assert config.tail_plan(24, 66, 2, 64) == (0, 48) and config.tail_plan(24, 66, 16, 64) == (0, 66)
    assert config.tail_plan(2, 66, 16, 3) == (0, 6)  # never more ranges than K-tiles
    cfg = registry.get(registry.DEFAULT)
    whole = config.estimate(cfg, 8192, 1280, 8192, 132, 1)
    sk = config.estimate(cfg, 8192, 1280, 8192, 132, 2)
    assert (sk.tail_tiles, sk.tail_units) == (94, 66)
    assert sk.us / whole.us == pytest.approx((1 + 1.42 * 1.32) / 3, abs=0.03)
    assert config._split_options(cfg, 8192, 1280, 8192, 132) == [1, 2]
    assert config._split_options(cfg, 1024, 768, 4096, 132) == [1, 2, 3, 4, 5, 6]  # 12 tiles: 6 fill 66


def test_configs_restrict_the_choice():
    c = config.choose(2048, 1280, 8192, "bf16", "nk", 132, configs=["128x128_c2x1_pp"], use_cache=False)
    assert c.config == "128x128_c2x1_pp" and c.split == 1  # pingpong: no split


def test_argument_errors():
    with pytest.raises(FluxShmemError, match="bfloat16 or float16"):
        config.choose(8, 8, 8, "fp32", "nk", 132)
    with pytest.raises(FluxShmemError, match="layout"):
        config.choose(8, 8, 8, "bf16", "mk", 132)
    with pytest.raises(FluxShmemError, match="sm_count"):
        config.choose(8, 8, 8, "bf16", "nk", 0)
    with pytest.raises(FluxShmemError, match="bad GEMM size"):
        config.choose(0, 8, 8, "bf16", "nk", 132)
    assert config.dtype_name("torch.bfloat16") == "bf16" and config.dtype_name("fp16") == "fp16"


def test_forced_overrides(monkeypatch):
    monkeypatch.setenv(config.ENV_FORCE, "config=128x128_c2x1_pp,swizzle=1")
    c = config.choose(8192, 1280, 8192, "bf16", "nk", 132, use_cache=False)
    assert (c.config, c.swizzle, c.split, c.source) == ("128x128_c2x1_pp", 1, 1, "forced")
    monkeypatch.setenv(config.ENV_FORCE, "split=3")
    c = config.choose(8192, 8192, 8192, "bf16", "nk", 132, use_cache=False)
    assert (c.config, c.split) == (registry.DEFAULT, 3) and "split=3" in c.describe()
    monkeypatch.setenv(config.ENV_FORCE, "128x128_c2x1")  # a bare name
    assert config.choose(8192, 1280, 8192, "bf16", "nk", 132, use_cache=False).config == "128x128_c2x1"
    for bad, why in (("swizzle=3", "swizzle must be one of"), ("split=99", "split must be"),
                     ("tile=128", "keys are config, swizzle, split and chunks"), ("nope", "unknown GEMM kernel")):
        monkeypatch.setenv(config.ENV_FORCE, bad)
        with pytest.raises(FluxShmemError, match=f"{config.ENV_FORCE}=.*{why}"):
            config.choose(8192, 1280, 8192, "bf16", "nk", 132, use_cache=False)


# --- the tuning cache ----------------------------------------------------------------------------------------------

def _entry(**kw) -> Entry:
    base = dict(config="128x128_c2x1_pp", swizzle=4, split=1, ms=0.25, heuristic_ms=0.3, candidates=6,
                family="gemm_rs", measured="2026-12-03T00:00:00+00:00")
    base.update(kw)
    return Entry(**base)


def test_cache_keys():
    assert tune_cache.entry_key(H200, "bf16", "nk", 8192, 1280, 8192) == "NVIDIA H200|sm132|cuda13.0|bf16|nk|8192x1280x8192"
    keys = {tune_cache.entry_key(d, dt, lay, *s) for d in (H200, dataclasses.replace(H200, sm_count=124),
                                                            dataclasses.replace(H200, gpu="NVIDIA H100 80GB HBM3"),
                                                            dataclasses.replace(H200, cuda="12.8"))
            for dt in ("bf16", "fp16") for lay in ("kn", "nk") for s in ((8192, 1280, 8192), (1280, 8192, 8192))}
    assert len(keys) == 4 * 2 * 2 * 2
    with pytest.raises(TuneCacheError, match="cannot be a cache key"):
        tune_cache.entry_key(DeviceKey("a|b", 132, "13.0"), "bf16", "nk", 1, 1, 1)


def test_cache_round_trip_and_choice(tmp_path):
    path = tune_cache.default_path()
    key = tune_cache.entry_key(H200, "bf16", "nk", 8192, 1280, 8192)
    tune_cache.update(path, {key: _entry()})
    assert tune_cache.load(path)[key] == _entry()
    c = config.choose(8192, 1280, 8192, "bf16", "nk", 132, device=H200)
    assert (c.config, c.swizzle, c.split, c.source) == ("128x128_c2x1_pp", 4, 1, "tuned")
    assert "measured 250 us on NVIDIA H200" in c.describe()
    # another SM count, layout or GPU is another key: the heuristic answers
    assert config.choose(8192, 1280, 8192, "bf16", "nk", 124, device=H200).source == "heuristic"
    assert config.choose(8192, 1280, 8192, "bf16", "kn", 132, device=H200).source == "heuristic"
    # the fused ops' group cap applies to tuned choices too
    capped = config.choose(8192, 1280, 8192, "bf16", "nk", 132, group_rows=256, device=H200)
    assert capped.swizzle == 1 and "capped at 1 by group_rows=256" in capped.reason
    # a configuration the caller excludes is not taken from the cache
    assert config.choose(8192, 1280, 8192, "bf16", "nk", 132, device=H200,
                         configs=["128x256_c2x1"]).source == "heuristic"
    assert config.choose(8192, 1280, 8192, "bf16", "nk", 132, device=H200, use_cache=False).source == "heuristic"


def test_cache_reloads_when_another_process_writes():
    path = tune_cache.default_path()
    view = tune_cache.TuneCache(path)
    assert view.lookup(H200, "bf16", "nk", 64, 64, 64) is None
    tune_cache.update(path, {tune_cache.entry_key(H200, "bf16", "nk", 64, 64, 64): _entry()})
    assert view.lookup(H200, "bf16", "nk", 64, 64, 64) == _entry()


@pytest.mark.parametrize("content,why", [
    ("{not json", "not valid JSON"),
    ('{"entries": {}}', "not a flux_shmem GEMM tuning cache"),
    ('{"format": "flux_shmem.gemm_tune", "version": 99, "entries": {}}', "version 99, this flux_shmem reads"),
    ('{"format": "flux_shmem.gemm_tune", "version": 1, "registry": "0ld", "entries": {}}', "stale"),
])
def test_invalid_or_stale_files_are_rejected(content, why):
    path = tune_cache.default_path()
    path.write_text(content)
    with pytest.raises(TuneCacheError, match=why) as ei:
        tune_cache.load(path)
    assert str(path) in str(ei.value) and ("flux_shmem.tune" in str(ei.value) or "delete" in str(ei.value))
    # the chooser warns once and falls back to the heuristic
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        c = config.choose(8192, 1280, 8192, "bf16", "nk", 132, device=H200)
    assert c.source == "heuristic" and any(why.split(",")[0] in str(w.message) for w in caught)
    # writers refuse to merge into it, unless told to start over
    with pytest.raises(TuneCacheError):
        tune_cache.update(path, {})
    tune_cache.update(path, {}, fresh=True)
    assert tune_cache.load(path) == {}


@pytest.mark.parametrize("raw,why", [
    ({"config": "gone_config"}, "registry does not have"),
    ({"swizzle": 3}, "swizzle 3"),
    ({"split": 2}, "split 2"),  # pingpong entries cannot split
    ({"ms": 0}, "must be > 0"),
    ({"colour": "red"}, "unknown fields"),
])
def test_invalid_entries_are_rejected(raw, why):
    path = tune_cache.default_path()
    entry = _entry().to_json()
    entry.update(raw)
    doc = {"format": tune_cache.FORMAT, "version": tune_cache.VERSION, "registry": registry.fingerprint(),
           "entries": {tune_cache.entry_key(H200, "bf16", "nk", 1, 2, 3): entry}}
    path.write_text(json.dumps(doc))
    with pytest.raises(TuneCacheError, match=why):
        tune_cache.load(path)
    with pytest.raises(TuneCacheError, match="bad key|is not 'GPU"):
        doc["entries"] = {"bad key": _entry().to_json()}
        path.write_text(json.dumps(doc))
        tune_cache.load(path)


def _writer(path: str, worker: int, count: int) -> None:
    for i in range(count):
        key = tune_cache.entry_key(H200, "bf16", "nk", 128 * (worker + 1), 8 * (i + 1), 64)
        tune_cache.update(path, {key: _entry(ms=0.1 + i)})


def test_concurrent_writers_lose_nothing(tmp_path):
    path = str(tmp_path / "shared.json")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, w, 12)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    entries = tune_cache.load(path)
    assert len(entries) == 4 * 12
    assert not list(tmp_path.glob("shared.json.*.tmp"))  # no temporary left behind


def test_tune_cli_check(capsys):
    from flux_shmem import tune as cli
    path = tune_cache.default_path()
    tune_cache.update(path, {tune_cache.entry_key(H200, "bf16", "nk", 8192, 1280, 8192): _entry()})
    assert cli.main(["--check"]) == 0
    assert "1 entries" in capsys.readouterr().out
    path.write_text("{")
    assert cli.main(["--check"]) == 1
    assert "not valid JSON" in capsys.readouterr().err


def test_fused_ops_choose_within_their_tile_height(monkeypatch):
    """The fused ops ask the chooser too (issue 11): the fused GEMM keeps the op's tile height and whole tiles,
    the plain GEMM of AllGatherGEMM may take any configuration. Their tuning-cache entries and forced fields are
    snapshots (PE 0's, agreed at construction), never the file or the environment of the calling PE."""
    import dataclasses
    from flux_shmem.plan import costs
    from flux_shmem.plan.inputs import PlanInputs

    same_height = tuple(c for c in registry.names() if registry.get(c).tile_m == registry.get(registry.DEFAULT).tile_m)
    inp = PlanInputs(family="ag_gemm", world=8, node_size=8, n=1280, k=8192, dtype="bf16", elem_bytes=2,
                     mode="auto", budget_sms=132, sms=132, cluster_m=2, links=costs.Links(), comm_blocks=None,
                     fused_configs=same_height, plain_configs=None)
    monkeypatch.setattr(config, "_tuned", lambda *a, **k: pytest.fail("the fused ops read no cache file"))
    plain = inp.choice(1024, "nk", 132, False)
    assert plain.split > 1  # under one wave, the plain GEMM cuts the tiles into pieces ...
    fused = inp.choice(1024, "nk", 132, True)
    assert fused.config in same_height and fused.split == 1 and "fused: whole tiles" in fused.reason  # ... not fused
    monkeypatch.setenv(config.ENV_FORCE, "config=128x256_c2x1")  # this PE's environment: ignored
    forced = dataclasses.replace(inp, forced=(("config", "128x128_c2x1_pp"),))
    assert forced.choice(8192, "nk", 116, True).config == "128x128_c2x1_pp"
    entry = tune_cache.Entry("128x128_c2x1", 2, 1, 0.05, candidates=3, measured="now")
    tuned = dataclasses.replace(inp, tuned=((("nk", 4096, 132), entry),))
    c = tuned.choice(4096, "nk", 132, False)
    assert (c.config, c.swizzle, c.source) == ("128x128_c2x1", 2, "tuned")
    assert tuned.choice(4096, "kn", 132, False).source == "heuristic"
