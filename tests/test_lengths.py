"""Lengths that vary (issue 41): the bucket table and the token budget of a surface, their worst cases found
exactly, their verification by the policy against synthetic memory, and the one-line refusals."""

from __future__ import annotations

import pytest
from test_surface import make_surface, run, surface_memory

from vramcal.calibration.lengths import (
    BUDGET,
    LengthSizing,
    bucket_of,
    bucket_table,
    default_buckets,
    next_check,
    padded_length,
    parse_buckets,
    settle_lengths,
    token_budget,
)
from vramcal.calibration.search import SearchSettings
from vramcal.calibration.surface import answer_at, settle_surface
from vramcal.records import Trial

from fakes import GIB


def test_padding_rounds_up_to_the_chunk():
    assert [padded_length(n, 64) for n in (1, 63, 64, 65, 128, 129)] == [64, 64, 64, 128, 128, 192]


def test_the_budget_is_the_exact_minimum_over_every_length():
    """Brute force over every length of the range: the budget fits at each, one token more does not somewhere."""
    surface, usable = make_surface(), 60 * GIB
    budget = token_budget(surface, usable, 0.9)

    def safe(length):  # the batch the surface allows for documents up to this length
        return answer_at(surface, max(padded_length(length, 64), 128), usable, 0.9)[0]

    lengths = range(128, 2049)
    assert all(budget.tokens // n <= safe(n) for n in lengths)
    assert any((budget.tokens + 1) // n > safe(n) for n in lengths)
    assert budget.batch_size(budget.worst_seq_len) == safe(budget.worst_seq_len)  # the worst batch sits at its limit
    assert all(budget.conservative_tokens // n <= answer_at(surface, max(padded_length(n, 64), 128), usable, 0.9)[1]
               for n in lengths)


def test_the_worst_length_is_the_one_with_the_most_padding_when_padding_binds():
    """With no per-sample term, a batch of 65-token documents padded to 128 costs the most per token."""
    settings = SearchSettings(total_bytes=80 * GIB, max_trials=24)
    memory = surface_memory(0.1 * settings.usable_bytes, settings.usable_bytes / 3e6, 0)
    seq_lens = (64, 256, 1024)
    trials = run(memory, settings, seq_lens)
    surface, _, _ = settle_surface(trials, seq_lens, 64, settings)
    budget = token_budget(surface, settings.usable_bytes, 0.9)
    assert budget.worst_seq_len == 65 and budget.worst() == (128, budget.tokens // 65)
    # no coarse sample could have found it: the budget at the chunk's own multiples alone is larger
    assert budget.tokens < min(n * (answer_at(surface, max(n, 64), settings.usable_bytes, 0.9)[0] + 1) - 1
                               for n in range(64, 1025, 64))


def test_buckets_size_each_at_its_longest_length_padded():
    surface = make_surface()
    table = bucket_table(surface, (100, 300, 2048), 75 * GIB, 0.9)
    assert [(b.shortest_seq_len, b.longest_seq_len, b.padded_seq_len) for b in table] == [
        (1, 100, 128), (101, 300, 320), (301, 2048, 2048)]
    assert table[0].safe_batch_size == 900 and table[0].basis == "verified"  # below the range: the shortest's
    assert table[2].safe_batch_size == surface.at(2048).safe_batch_size
    assert bucket_of(table, 300) is table[1]
    assert default_buckets(surface) == (128, 256, 512, 1024, 2048)
    assert parse_buckets("512, 128,256") == (128, 256, 512) and parse_buckets("auto") == ()


def test_lengths_outside_the_buckets_or_the_profile_are_one_line_refusals():
    surface = make_surface()
    with pytest.raises(ValueError, match="the bucket 4096 is longer than the profile's longest seq_len 2048: "
                                         "calibrate up to it"):
        bucket_table(surface, (128, 4096), 75 * GIB, 0.9)
    with pytest.raises(ValueError, match="no bucket covers a document of 600 tokens: the buckets hold 1-512"):
        bucket_of(bucket_table(surface, (128, 512), 75 * GIB, 0.9), 600)
    with pytest.raises(ValueError, match="a document of 3000 tokens is longer than the profile's longest seq_len 2048"):
        token_budget(surface, 75 * GIB, 0.9).batch_size(3000)
    with pytest.raises(ValueError, match="cannot read the buckets 'x,1'"):
        parse_buckets("x,1")
    with pytest.raises(ValueError, match="one document of 2048 tokens does not fit"):
        token_budget(surface, 75 * GIB, 0.9, failed=[(128, 1)])


def drive(memory, settings, seq_lens, chunk=64):
    """The surface policy, then the budget's verifications, against ``memory`` (fake trials)."""
    core = run(memory, settings, seq_lens)
    surface, _, _ = settle_surface(core, seq_lens, chunk, settings)
    checks = []
    while (chosen := next_check(core, checks, surface, settings)) is not None:
        length, step = chosen
        peak = int(memory(step.batch_size, length))
        status = "oom" if peak > settings.total_bytes else "ok"
        checks.append(Trial(step.batch_size, status, peak if status == "ok" else None, purpose=step.purpose,
                            seq_len=length))
    return core, checks, surface


def test_the_policy_verifies_both_budgets_at_their_worst_batch():
    settings = SearchSettings(total_bytes=40 * GIB, max_trials=24)
    usable = settings.usable_bytes
    memory = surface_memory(0.1 * usable, usable / 3e6, usable / 3e4)
    core, checks, surface = drive(memory, settings, (128, 512, 2048))
    found = settle_lengths(core, checks, surface, settings)
    assert found.verified and 1 <= len(checks) <= 2, checks
    length, batch = found.budget.worst()
    assert (found.verification["budget"].seq_len, found.verification["budget"].batch_size) == (length, batch)
    assert memory(batch, length) <= usable
    assert found.verification["buckets"].seq_len == 2048 and found.buckets[-1].padded_seq_len == 2048
    assert LengthSizing.from_dict(found.to_dict()) == found


def test_a_budget_whose_worst_batch_fails_comes_down_and_is_verified_again():
    """Memory the surface under-predicts at short padded lengths: the first check fails, the budget comes down."""
    settings = SearchSettings(total_bytes=40 * GIB, max_trials=24)
    usable = settings.usable_bytes
    smooth = surface_memory(0.1 * usable, usable / 3e6, usable / 3e4)
    core = run(smooth, settings, (128, 512, 2048))
    surface, _, _ = settle_surface(core, (128, 512, 2048), 64, settings)
    first = next_check(core, [], surface, settings)
    bumpy = lambda b, n: smooth(b, n) * (1.08 if n < 512 else 1.0)  # noqa: E731 - 8 % more at the worst length
    checks = [Trial(first[1].batch_size, "ok", int(bumpy(first[1].batch_size, first[0])), purpose=BUDGET,
                    seq_len=first[0])]
    assert checks[0].peak_bytes > usable
    again = next_check(core, checks, surface, settings)
    assert again is not None and (again[0], again[1].batch_size) != (first[0], first[1].batch_size)
    lowered = settle_lengths(core, checks, surface, settings)
    assert lowered.budget.tokens < token_budget(surface, usable, 0.9).tokens and not lowered.verified
    # no batch the lowered budget forms at that padded length or longer reaches the size that failed
    assert all(lowered.budget.batch_size(n) < first[1].batch_size for n in range(128, 2049)
               if padded_length(n, 64) >= first[0])


def test_the_profile_carries_both_and_the_report_and_limits_show_them(tmp_path):
    """A calibration over three lengths (trials faked at the hardware boundary): the budget verified by its own
    check at its worst length, read back from the file, shown by the report and by `vramcal limits`."""
    import json

    from click.testing import CliRunner

    from vramcal.cli import main
    from vramcal.profile import load_profile, save_profile
    from vramcal.report import write_report

    from fakes import fake_calibration

    memory = lambda b, n: GIB + 20_000 * b * n + 3 * 2**20 * b  # noqa: E731
    profile = fake_calibration(memory, 12 * GIB, max_trials=40, seq_lens=(128, 512, 2048), kind="cuda")
    sized = profile.lengths
    assert sized.verified and sized.trials and sized.trials[0].purpose == BUDGET
    assert not any(t.purpose == BUDGET for t in profile.trials)  # kept apart from the search's trials
    path = save_profile(profile, tmp_path / "p.json")
    assert load_profile(path) == profile
    _, markdown = write_report([profile], tmp_path)
    text = markdown.read_text()
    assert "## Lengths that vary" in text and "- Worst case, the token budget (its worst length: documents of " in text
    assert "verified by the calibration's trial" in text
    shown = CliRunner().invoke(main, ["limits", str(path), "--token-budget", "--json"])
    assert shown.exit_code == 0, shown.output
    assert json.loads(shown.output)["token_budget"]["tokens"] == sized.budget.tokens
    alone = CliRunner().invoke(main, ["limits", str(path), "--token-budget", "--seq-len", "128"])
    assert alone.exit_code == 2 and "--seq-len and --token-budget ask different questions" in alone.output


def test_the_probe_command_of_an_lm_profile_over_several_lengths_names_no_length():
    """Such a profile's model keeps no seq_len: `vramcal limits` on it once failed with a KeyError there."""
    from vramcal.models.registry import family_of
    from vramcal.workload import ModelRef

    ref = ModelRef.make("vramcal.models.lm:training_step", {"config": {"hidden_size": 64}, "dtype": "fp32"})
    assert "--seq-len <its lengths>" in family_of(ref).probe_args(ref)
