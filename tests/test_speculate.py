"""Acceptance rules of DFlash speculation: greedy, batched greedy, and lossless sampling."""

import pytest
import torch

from agentflash.dflash.speculate import (
    greedy_accept,
    greedy_accept_batch,
    lookup_draft,
    sample_accept,
)


def logits_with_argmax(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    out = torch.randn(len(tokens), vocab)
    out[torch.arange(len(tokens)), torch.tensor(tokens)] = 100.0
    return out  # [len(tokens), V]


@pytest.mark.parametrize(
    "draft, target, accepted, bonus",
    [
        ([4, 5, 6], [4, 5, 6, 7], 3, 7),  # every draft token stands, the last row gives the bonus
        ([4, 5, 6], [1, 5, 6, 7], 0, 1),  # the first token already differs
        ([4, 5, 6], [4, 2, 6, 7], 1, 2),  # a later match after a mismatch does not count
        ([4, 5, 6], [4, 5, 9, 7], 2, 9),
        ([], [3], 0, 3),  # a block of one: no draft, plain decoding
    ],
)
def test_greedy_accept(draft, target, accepted, bonus):
    got = greedy_accept(torch.tensor(draft, dtype=torch.long), logits_with_argmax(target))
    assert got == (accepted, bonus)


def test_greedy_accept_batch_equals_rows_of_different_lengths():
    torch.manual_seed(0)
    vocab, t = 4, 6
    lengths = torch.tensor([6, 3, 0, 5, 1])
    drafts = torch.randint(0, vocab, (5, t))
    targets = torch.randint(0, vocab, (5, t + 1))
    targets[0, :4] = drafts[0, :4]  # a long matching prefix, then a mismatch
    targets[0, 4] = (drafts[0, 4] + 1) % vocab
    targets[3, :5] = drafts[3, :5]  # a row whose whole draft matches
    logits = torch.stack([logits_with_argmax(row.tolist(), vocab) for row in targets])
    accepted, bonus = greedy_accept_batch(drafts, lengths, logits)
    for b, n in enumerate(lengths.tolist()):
        assert (int(accepted[b]), int(bonus[b])) == greedy_accept(drafts[b, :n], logits[b, : n + 1])
    assert int(accepted[0]) == 4 and int(accepted[3]) == 5 and int(accepted[2]) == 0


# --- sampling ----------------------------------------------------------------------------------
# A toy target over a tiny vocabulary: the next-token distribution depends on the last two tokens.

VOCAB = 3
_TABLE = torch.softmax(
    torch.randn(VOCAB, VOCAB, VOCAB, generator=torch.Generator().manual_seed(1)) * 1.5, dim=-1
)


def toy_probs(prefix: list[int]) -> torch.Tensor:
    return _TABLE[prefix[-2], prefix[-1]]  # [V]


def plain_sampling(prefix: list[int], n: int, gen: torch.Generator) -> list[int]:
    out = list(prefix)
    for _ in range(n):
        out.append(int(torch.multinomial(toy_probs(out), 1, generator=gen)))
    return out[len(prefix) :]


def speculative_sampling(
    prefix: list[int], n: int, gen: torch.Generator, draft_gen: torch.Generator, block: int = 4
) -> list[int]:
    out = list(prefix)
    while len(out) - len(prefix) < n:
        draft = torch.randint(0, VOCAB, (block - 1,), generator=draft_gen)  # any proposal at all
        path = out + draft.tolist()
        probs = torch.stack([toy_probs(path[: len(out) + i]) for i in range(block)])  # [T+1, V]
        accepted, bonus = sample_accept(draft, probs, gen)
        out += draft[:accepted].tolist() + [bonus]
    return out[len(prefix) : len(prefix) + n]


def test_sample_accept_commits_the_same_tokens_as_plain_sampling_for_a_seed():
    for seed in range(20):
        plain = plain_sampling([0, 1], 12, torch.Generator().manual_seed(seed))
        spec = speculative_sampling(
            [0, 1],
            12,
            torch.Generator().manual_seed(seed),
            torch.Generator().manual_seed(100 + seed),
        )
        assert spec == plain


def test_sample_accept_preserves_the_target_distribution():
    # Exact law of the first three tokens after [0, 1] against counts under speculation with a
    # drafter that proposes from its own (wrong) distribution; unseeded speculation loses nothing.
    prefix, n, draws = [0, 1], 3, 6000
    exact = {}
    for seq in torch.cartesian_prod(*[torch.arange(VOCAB)] * n).tolist():
        p, path = 1.0, list(prefix)
        for tok in seq:
            p *= float(toy_probs(path)[tok])
            path.append(tok)
        exact[tuple(seq)] = p
    gen, draft_gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)
    counts = dict.fromkeys(exact, 0)
    for _ in range(draws):
        counts[tuple(speculative_sampling(prefix, n, gen, draft_gen))] += 1
    chi2 = sum((counts[s] - draws * p) ** 2 / (draws * p) for s, p in exact.items())
    dof = len(exact) - 1  # 26; the 0.999 quantile of chi-square(26) is about 54
    assert chi2 < 54.1, f"chi-square {chi2:.1f} with {dof} degrees of freedom"
    # and the test can tell a wrong law apart: a drafter-biased one is rejected
    biased = {s: (p + (1 / len(exact))) / 2 for s, p in exact.items()}
    chi2_biased = sum((counts[s] - draws * p) ** 2 / (draws * p) for s, p in biased.items())
    assert chi2_biased > 54.1


def test_sample_accept_takes_the_draft_only_when_the_target_draws_it():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # [T+1, V]
    gen = torch.Generator().manual_seed(0)
    assert sample_accept(torch.tensor([1, 2]), probs, gen) == (2, 0)
    assert sample_accept(torch.tensor([1, 0]), probs, gen) == (1, 2)
    assert sample_accept(torch.tensor([2, 2]), probs, gen) == (0, 1)


def test_lookup_drafts_what_followed_the_latest_match_of_the_longest_suffix():
    # the suffix (1, 2, 3) occurred twice; the latest occurrence's continuation wins
    assert lookup_draft([1, 2, 3, 7, 1, 2, 3, 4, 5, 6, 9, 1, 2, 3], 3) == [4, 5, 6]
    # (5, 2, 3) never occurred: the 2-gram (2, 3) did
    assert lookup_draft([2, 3, 8, 8, 5, 2, 3], 2) == [8, 8]
    assert lookup_draft([1, 2, 3, 4], 4) == []  # nothing repeats
    assert lookup_draft([4, 4, 9, 1, 2, 3], 3, window=4) == []  # the match is out of the window


def test_a_lookup_that_runs_into_the_end_goes_on_as_a_loop():
    assert lookup_draft([7, 3, 5, 3, 5, 3, 5], 5) == [3, 5, 3, 5, 3]  # period 2
    assert lookup_draft([9, 8, 8, 8], 4) == [8, 8, 8, 8]  # period 1
    assert lookup_draft([1, 2, 3, 1, 2, 3], 7) == [1, 2, 3, 1, 2, 3, 1]  # period 3
