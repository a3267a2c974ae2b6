"""The parallel layout is one object with one parser and one set of defaults: every layout string the project
shows a user parses, means the same Layout as the [parallel] table written from it, and the trainer (`verify`),
the planner (`plan --write-config`) and the simulator resolve it to the same ZeRO stage."""

import dataclasses
import re
import tomllib
from pathlib import Path

import pytest

from shardwise.config import ConfigError, from_dict, load_config, toml_value
from shardwise.layout import BATCH_KEYS, LAYOUT_KEYS, Layout, complete_layout, parse_layout

ROOT = Path(__file__).parent.parent
CONFIG = str(Path(__file__).parent / "configs" / "parity.toml")
KEYS = {"dp", *LAYOUT_KEYS, *BATCH_KEYS}
_STRING = re.compile(r"[\"'`]((?:[a-z_]+=[\w.-]+,)*[a-z_]+=[\w.-]+)[\"'`]")


def _layout_strings() -> list[str]:
    """Every quoted `key=value,...` string in the README, docs, tests and benchmarks whose keys are all layout
    keys and that names at least one degree (the rest are other key=value lists)."""
    found = set()
    sources = [ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py")]
    for path in (p for p in sources if p.name != Path(__file__).name):  # this file's bad strings are meant to fail
        for text in _STRING.findall(path.read_text()):
            keys = {item.partition("=")[0] for item in text.split(",")}
            if keys <= KEYS and keys & {"dp", "dp_replicate", "dp_shard", "tp", "pp", "cp"}:
                found.add(text)
    return sorted(found)


STRINGS = _layout_strings()


def test_the_project_shows_layout_strings():
    assert len(STRINGS) >= 40, STRINGS  # the scan finds them (README, docs/planner.md, the parity tests, ...)


@pytest.mark.parametrize("text", STRINGS)
def test_a_layout_string_and_its_toml_table_are_one_layout(text):
    layout = complete_layout(parse_layout(text))
    table = "[parallel]\n" + "\n".join(f"{k} = {toml_value(v)}" for k, v in dataclasses.asdict(layout).items())
    assert from_dict(tomllib.loads(table)).parallel == layout  # read back as a job's TOML is read


@pytest.mark.parametrize("text", ["dp=2", "dp=4,zero_stage=1", "dp_shard=2", "dp_replicate=2,dp_shard=2",
                                  "tp=2,dp=2", "dp_shard=2,zero_stage=2", "pp=2,dp=2", "cp=2,dp_shard=2"])
def test_verify_plan_and_simulate_resolve_one_zero_stage(text, tmp_path):
    from shardwise.planner.cli import complete_plan
    from shardwise.planner.config_out import write_config
    from shardwise.planner.workload import Training
    from shardwise.simulate import config_from_plan
    from shardwise.verify import layout_overrides

    expected = complete_layout(parse_layout(text))
    world = expected.world_size
    verified = load_config(CONFIG, layout_overrides(text)).parallel
    simulated = config_from_plan("tiny", text, world, seq_len=64, micro_batch=2, precision="fp32").parallel
    training = Training(seq_len=64, global_batch=4 * expected.dp)
    model = load_config(CONFIG).model
    write_config(tmp_path / "plan.toml", model, training, complete_plan(
        parse_layout(text, "--plan"), training, world, model))
    planned = load_config(tmp_path / "plan.toml").parallel
    for got in (verified, simulated, planned):
        assert (got.zero_stage, got.dp_replicate, got.dp_shard) == (
            expected.zero_stage, expected.dp_replicate, expected.dp_shard), got


def test_expert_parallelism_alone_shards_the_data_parallel_ranks_everywhere():
    """`plan --plan ep=2` on 4 GPUs ran it over dp_shard 4 (ZeRO-3), while `train --nproc 4 --set parallel.ep=2`,
    `simulate --world 4 --plan ep=2` and `verify --layout ep=2` filled dp_replicate (ZeRO-0) and refused it as
    'zero_stage is 0': ep draws its ranks from dp_shard, so a layout with ep and no zero_stage is sharded."""
    from shardwise.config import fit_world
    from shardwise.planner.cli import complete_plan
    from shardwise.planner.workload import Training
    from shardwise.simulate import config_from_plan

    moe = str(Path(CONFIG).parent / "moe.toml")
    expected = complete_layout(parse_layout("ep=2"), world=4)
    assert (expected.dp_shard, expected.zero_stage, expected.ep) == (4, 3, 2)
    trained = load_config(moe, ["parallel.ep=2"])
    fit_world(trained, 4)
    simulated = config_from_plan("debug-moe", "ep=2", 4, seq_len=64, micro_batch=2, precision="fp32").parallel
    planned = complete_plan(parse_layout("ep=2", "--plan"), Training(seq_len=64, global_batch=8), 4, trained.model)
    for got in (trained.parallel, simulated, planned):
        assert (got.dp_replicate, got.dp_shard, got.zero_stage, got.ep) == (1, 4, 3, 2), got
    # an explicit ZeRO-0/1 is still the user's, and refused with ep
    with pytest.raises(ConfigError, match="zero_stage is 0"):
        load_config(moe, ["parallel.ep=2", "parallel.zero_stage=0", "parallel.dp_replicate=2"])


def test_defaults_are_stated_once():
    assert complete_layout(parse_layout("dp=4")).zero_stage == 0  # data parallel: DDP
    assert complete_layout(parse_layout("dp_shard=4")).zero_stage == 3  # FSDP's default
    assert complete_layout(parse_layout("dp=4,zero_stage=2")).dp_shard == 4  # dp goes where ZeRO-2/3 shards
    assert complete_layout(parse_layout("tp=2"), world=8).dp_replicate == 4  # dp fills the world
    assert Layout(pp=2, pp_schedule="interleaved-1f1b").virtual_stages == 2
    interleaved = load_config(CONFIG, ["parallel.pp=2", "parallel.pp_schedule='interleaved-1f1b'"]).parallel
    assert interleaved.virtual_stages == 2


@pytest.mark.parametrize("text, field", [("tp=two", "--layout tp"), ("tp", "--layout"), ("zero=3", "--layout"),
                                          ("pp_schedule=2f2b", "--layout pp_schedule"),
                                          ("sequence_parallel=maybe", "--layout sequence_parallel"),
                                          ("dp=4,dp_replicate=2,dp_shard=1", "--layout dp")])
def test_a_bad_layout_string_names_its_key(text, field):
    with pytest.raises(ConfigError) as e:
        parse_layout(text)
    assert e.value.field == field


@pytest.mark.parametrize("args, field", [
    (["--layout", "dp_shard=2", "--steps", "0"], "--steps"),  # named train.steps
    (["--layout", "dp_shard=2", "--rtol", "nan"], "--rtol"),  # accepted: every layout then FAILed
    (["--layout", "dp_shard=2", "--rtol", "-1"], "--rtol"),
    (["--layout", ""], "--layout"),  # one device against itself: "ok"
    (["--layout", "dp_shard=2", "--set", "parallel.tp=2"], "--set"),  # said "add --nproc 2", which verify lacks
    (["--layout", "tp=1.5"], "--layout tp"),
])
def test_bad_verify_flags_are_one_line_before_any_run(args, field, capsys, monkeypatch):
    import shardwise.verify
    from shardwise.cli import main

    def no_run(*a, **k):
        raise AssertionError("a run was started")

    monkeypatch.setattr(shardwise.verify, "_train_here", no_run)
    monkeypatch.setattr(shardwise.verify, "_train_launched", no_run)
    assert main(["verify", "--config", str(Path(__file__).parent / "configs" / "parity.toml"), *args]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shardwise: error: {field}: "), lines
    if field == "--layout tp":
        assert "not a whole number" in lines[0]


def test_verify_compares_overflowed_steps():
    """An fp16 step both runs skip (inf gradient norm) matches; one that only one run skips, or a nan, does not
    (inf / inf made nan, and max() over the steps passed over it: a mismatch could print 'ok')."""
    from shardwise.verify import _rel

    inf, nan = float("inf"), float("nan")
    assert _rel(inf, inf) == 0.0 and _rel(2.0, 2.0) == 0.0
    assert _rel(1.0, inf) == inf and _rel(inf, 1.0) == inf and _rel(nan, 1.0) == inf and _rel(nan, nan) == inf
    assert max(_rel(a, b) for a, b in [(1.0, inf), (1.0, 1.0)]) == inf


def test_a_failed_layout_says_by_how_much_and_where(capsys, monkeypatch):
    """verify printed a failing layout as 'FAIL' alone: not the tolerance it failed, nor the parameter that differed
    most (which --json has, as worst_param)."""
    import shardwise.verify
    from shardwise.cli import main

    compare = shardwise.verify.compare

    def broken(ref, got):  # a layout whose parameters came out 1e-3 away from one device's
        return {**compare(ref, got), "param_rel": 1e-3, "worst_param": "layers.0.attention.wo.weight"}

    monkeypatch.setattr(shardwise.verify, "compare", broken)
    code = main(["verify", "--config", str(Path(__file__).parent / "configs" / "parity.toml"), "--set=model.n_layers=2",
                 "--layout", "micro_batch=4,grad_accum=2", "--steps", "1"])
    out = capsys.readouterr().out
    assert code == 1
    assert "FAIL (beyond --rtol 1e-05; parameters differ most in layers.0.attention.wo.weight)" in out, out


def test_verify_says_when_the_data_never_reads_a_tensor_parallel_ranks_embedding_rows(tmp_path):
    """ASCII text through the byte tokenizer reads ids below 128 of the parity model's 320: under tp 2 the second
    rank's embedding rows (160-319) are never looked up, so verify compares nothing of its lookup (an off-by-one in
    it passed `verify --layout tp=2`). The note names them; text with accented letters (UTF-8 bytes from 0xC2) reads
    both ranks' rows, and tp 1 has nothing to say."""
    from shardwise.verify import unread_embedding_note, unread_embedding_rows

    def cfg(text: str, tp: int):
        corpus = tmp_path / f"corpus-{len(text)}"
        corpus.mkdir(exist_ok=True)
        (corpus / "a.txt").write_text(text * 400)
        return load_config(CONFIG, [f"data.paths=['{corpus}']", f"data.cache_dir='{tmp_path / 'cache'}'",
                                    f"parallel.tp={tp}"])

    ascii_tp2 = cfg("the quick brown fox jumps over the lazy dog. ", 2)
    highest, unread = unread_embedding_rows(ascii_tp2, 2)
    assert highest < 128 and unread == [(160, 320)]
    note = unread_embedding_note("tp=2", ascii_tp2, 2)
    assert "rows 160-319 are never read" in note and "\n" not in note
    assert unread_embedding_rows(cfg("un café crème brûlée à la façon de là-bas. ", 2), 2)[1] == []
    assert unread_embedding_note("tp=1", cfg("the quick brown fox jumps over the lazy dog. ", 1), 2) is None


def test_verify_runs_its_reference_on_one_device_whatever_the_configs_parallel_table(tmp_path, monkeypatch):
    """A config with a [parallel] table (what `plan --write-config` writes) is verified as each --layout replaces
    that table; the one-device reference replaced none of it: it was refused as the planned job in one process
    ("the degrees ask for 8 ranks ...; fix: add --nproc 8", which verify lacks), or, before any run, for the
    table's pp_microbatches against train.micro_batch, which no run of verify uses (trial, 2026-12-02)."""
    import shardwise.verify
    from shardwise.cli import main

    config = tmp_path / "planned.toml"
    config.write_text(Path(CONFIG).read_text() + "\n[parallel]\ntp = 2\npp = 2\ncp = 2\nsequence_parallel = true\n"
                      "pp_schedule = 'zero-bubble'\npp_microbatches = 32\nzero_stage = 2\n")
    started = []

    class Started(Exception):
        pass

    def train_here(path, overrides, final):
        started.append(load_config(path, overrides))
        raise Started

    monkeypatch.setattr(shardwise.verify, "_train_here", train_here)
    with pytest.raises(Started):
        main(["verify", "--config", str(config), "--layout", "tp=2,pp=2", "--steps", "1"])
    (reference,) = started
    assert reference.parallel == Layout() and reference.parallel.world_size == 1
    assert reference.train.micro_batch == 8 // 2 and reference.train.grad_accum == 2  # the layout's pipeline cut


def test_a_dp_factor_that_does_not_divide_what_the_world_leaves_names_the_key_given():
    """`--plan "tp=2,pp=2,cp=2,dp_shard=3"` on 16 GPUs said "--plan dp: 3 does not divide dp=2", a dp never given."""
    with pytest.raises(ConfigError) as e:
        complete_layout(parse_layout("tp=2,pp=2,cp=2,dp_shard=3", "--plan"), 16, "--plan")
    assert e.value.field == "--plan dp_shard" and "the 2 data-parallel ranks" in e.value.problem
    with pytest.raises(ConfigError) as e:
        complete_layout(parse_layout("dp=4,dp_replicate=3", "--plan"), 4, "--plan")
    assert e.value.field == "--plan dp"
