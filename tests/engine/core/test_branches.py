"""APAR branch bookkeeping (engine/core/branches.py): forks, limits, rebuild, streaming, masking,
and the tree driven in multi-token steps against plain one-token decoding of every branch."""

from __future__ import annotations

import json
import random

import mlx.core as mx
import pytest

from redrafter_mlx.engine.base.errors import ParamError
from redrafter_mlx.engine.core.branches import (
    CHILD_TOKEN,
    FORK_TOKEN,
    BranchRules,
    BranchTree,
    Extension,
    Fork,
    branch_rules,
    find_token_id,
    mask_split_tokens,
)

F, C = 6, 7  # fork and child ids in the toy vocabulary (0 = EOS, 1..5 = text)
RULES = BranchRules(fork_id=F, child_id=C)


def test_fork_keeps_through_the_first_fork_and_rebuilds_root_detail_next():
    tree = BranchTree(RULES)
    step = tree.extend(0, [1, 2, F, 3, F])
    assert step == Extension(keep=3, fork=Fork(parent=0, child=1, prefix_len=3))
    assert tree.row(0) == [1, 2, F] and tree.row(1) == [1, 2, F, C]
    assert tree.extend(0, [3, 4]) == Extension(keep=2)
    assert tree.extend(1, [5, 5]) == Extension(keep=2)
    assert tree.row(1) == [1, 2, F, C, 5, 5]
    assert tree.linear() == [1, 2, 5, 5, 3, 4]


def test_final_prefix_holds_later_text_until_the_detail_is_finished():
    tree = BranchTree(RULES)
    tree.extend(0, [1, F])
    tree.extend(0, [2, 3])  # the next item, written beside the detail
    tree.extend(1, [4])
    assert tree.take_final() == [1, 4]  # the root's [2, 3] waits for the detail
    tree.extend(1, [5])
    assert tree.take_final() == [5]
    tree.finish(1)
    assert tree.take_final() == [2, 3]
    assert not tree.done
    tree.extend(0, [1])
    tree.finish(0)
    assert tree.done and tree.take_final() == [1] and tree.final() == tree.linear()


def test_depth_limit_stops_forking_at_depth_two():
    tree = BranchTree(RULES)
    assert tree.extend(0, [1, F]).fork.child == 1
    assert tree.extend(1, [2, F]).fork.child == 2  # depth 2 exists
    assert tree.branches[2].depth == 2 and not tree.fork_allowed(2)
    assert tree.fork_allowed_rows([0, 1, 2]) == [True, True, False]
    with pytest.raises(ValueError, match="past the depth limit"):
        tree.extend(2, [3, F])
    tree.extend(2, [3])
    assert tree.linear() == [1, 2, 3]


def test_branch_limit_counts_the_root():
    tree = BranchTree(BranchRules(F, C, max_branches=2))
    tree.extend(0, [1, F])
    assert not tree.fork_allowed(0) and not tree.fork_allowed(1)


def test_forks_in_one_step_past_the_branch_limit_are_dropped_as_rejected():
    tree = BranchTree(BranchRules(F, C, max_branches=3))
    tree.extend(0, [1, F])
    assert tree.fork_allowed_rows([0, 1]) == [True, True]  # the step's mask: both may fork
    assert tree.extend(0, [2, F, 3]).fork.child == 2  # the third branch: the last one
    assert tree.extend(1, [4, 5, F, 6]) == Extension(keep=2)  # its fork comes too late
    assert tree.row(1) == [1, F, C, 4, 5] and len(tree.branches) == 3


def test_child_token_emitted_freely_raises():
    tree = BranchTree(RULES)
    with pytest.raises(ValueError, match="only forced by a fork"):
        tree.extend(0, [1, C])


def test_fork_right_after_a_split_token_raises():
    tree = BranchTree(RULES)
    tree.extend(0, [1, F])
    with pytest.raises(ValueError, match="after a split token"):
        tree.extend(0, [F])  # the parent's row ends with its fork token
    with pytest.raises(ValueError, match="after a split token"):
        tree.extend(1, [F])  # the child's row ends with its child token
    tree.extend(0, [2])
    assert tree.extend(0, [F]).fork is not None  # one text token between: allowed


def test_finished_branch_takes_no_tokens():
    tree = BranchTree(RULES)
    tree.finish(0)
    with pytest.raises(ValueError, match="finished"):
        tree.extend(0, [1])


def test_rules_reject_bad_values():
    with pytest.raises(ParamError, match="distinct"):
        BranchRules(5, 5)
    with pytest.raises(ParamError, match="branch limit"):
        BranchRules(5, 6, max_branches=0)


def test_mask_split_tokens_bans_child_always_and_fork_after_split_or_past_limits():
    V = 8
    logits = mx.zeros((2, 3, V))
    tokens = mx.array([[1, F, C], [1, 2, 3]])
    fork_ok = mx.array([True, False])
    out = mask_split_tokens(logits, tokens, fork_ok, RULES)
    inf = float("inf")
    assert (out[:, :, C] == -inf).all().item()
    assert out[0, :, F].tolist() == [0.0, -inf, -inf]  # after F and after C
    assert out[1, :, F].tolist() == [-inf, -inf, -inf]  # row may not fork
    assert (out[:, :, :F] == 0).all().item()


# --- the tree in multi-token steps against plain decoding ------------------------------

V, EOS, ROW_CAP = 8, 0, 14


def toy_logits(context: list[int]) -> mx.array:
    """A deterministic toy model: (V,) logits from the row's last two tokens and length,
    fork-prone so that trees get deep."""
    rng = random.Random(hash((tuple(context[-2:]), len(context))) & 0xFFFFFFFF)
    values = [rng.gauss(0.0, 1.0) for _ in range(V)]
    values[F] += 1.2
    values[EOS] += 0.4 * len(context) / ROW_CAP
    return mx.array(values)


def greedy_next(row: list[int], fork_ok: bool) -> int:
    last = row[-1] if row else 1  # the prompt's last token
    logits = mask_split_tokens(
        toy_logits(row)[None, None], mx.array([[last]]), mx.array([fork_ok]), RULES
    )
    return int(mx.argmax(logits[0, 0]).item())


def plain(row: list[int], depth: int) -> list[int]:
    """Reference: one branch decoded one token at a time, each fork's detail decoded the
    same way from the fork onward, spliced in where the fork token stands."""
    text, own = [], []
    while len(row) + len(own) < ROW_CAP:
        t = greedy_next(row + own, fork_ok=depth < RULES.max_depth)
        if t == EOS:
            break
        own.append(t)
        if t == F:
            text.extend(plain(row + own + [C], depth + 1))
        else:
            text.append(t)
    return text


@pytest.mark.parametrize("seed", range(4))
def test_tree_in_random_steps_equals_plain_decoding_of_each_branch(seed):
    rng = random.Random(seed)
    tree = BranchTree(RULES)  # 32 branches: never reached here, so order cannot matter
    active = [0]
    while active:
        for b in list(active):
            row, step, ended = tree.row(b), [], False
            for _ in range(rng.randint(1, 4)):  # a speculative step accepts 1..4 tokens
                if len(row) + len(step) >= ROW_CAP:
                    ended = True
                    break
                t = greedy_next(row + step, tree.fork_allowed(b))
                if t == EOS:
                    ended = True
                    break
                step.append(t)
            fork = tree.extend(b, step).fork
            if fork is not None:  # anything after the fork (an EOS too) is redrawn
                assert tree.row(fork.child)[:-1] == tree.row(b)[: fork.prefix_len]
                active.append(fork.child)
            elif ended:
                tree.finish(b)
                active.remove(b)
    expected = plain([], 0)
    assert 2 < len(tree.branches) < RULES.max_branches
    assert max(b.depth for b in tree.branches) == RULES.max_depth
    assert tree.linear() == expected == tree.final()


# --- token lookup --------------------------------------------------------------------


def test_find_token_id_reads_each_tokenizer_file(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "added_tokens.json").write_text(json.dumps({FORK_TOKEN: 32000}))
    assert find_token_id(tmp_path / "a", FORK_TOKEN) == 32000
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tokenizer.json").write_text(
        json.dumps(
            {"added_tokens": [{"id": 49153, "content": CHILD_TOKEN}], "model": {"vocab": {"x": 1}}}
        )
    )
    assert find_token_id(tmp_path / "b", CHILD_TOKEN) == 49153
    assert find_token_id(tmp_path / "b", FORK_TOKEN) is None
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "tokenizer_config.json").write_text(
        json.dumps({"added_tokens_decoder": {"7": {"content": FORK_TOKEN}}})
    )
    assert find_token_id(tmp_path / "c", FORK_TOKEN) == 7


def test_branch_rules_modes(tmp_path):
    (tmp_path / "added_tokens.json").write_text(json.dumps({FORK_TOKEN: 10, CHILD_TOKEN: 11}))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert branch_rules(tmp_path, "auto") is None  # no branches block: a plain model
    assert branch_rules(tmp_path, "on", max_depth=1) == BranchRules(10, 11, max_depth=1)
    assert branch_rules(tmp_path, "off") is None
    (tmp_path / "config.json").write_text(
        json.dumps({"branches": {"fork": FORK_TOKEN, "child": CHILD_TOKEN}})
    )
    assert branch_rules(tmp_path) == BranchRules(10, 11)
    with pytest.raises(ParamError, match="--branches must be one of"):
        branch_rules(tmp_path, "yes")


def test_branches_on_without_split_tokens_names_the_problem_and_the_fix(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "added_tokens.json").write_text(json.dumps({FORK_TOKEN: 10}))
    with pytest.raises(ParamError, match=r"no \[SplitSop\].*--branches off") as e:
        branch_rules(tmp_path, "on")
    assert e.value.param == "branches"
