"""The KV key scheme: what changes a key and what does not."""
import pytest

from prefillshare.app.engine.pool.kv_keys import block_keys, key_salt, shared_block_keys

TOKENS = list(range(3, 3 + 70))  # 2 full blocks of 32 + a partial block of 6


def test_blocks_cover_the_tokens_full_then_partial():
    keys = block_keys("base", "t", TOKENS, 32)
    assert [(k.index, k.start, k.num_tokens, k.full) for k in keys] == [
        (0, 0, 32, True), (1, 32, 32, True), (2, 64, 6, False)]
    assert len({k.key for k in keys}) == 3


def test_same_input_same_keys_and_prefix_stability():
    a = block_keys("base", "t", TOKENS, 32)
    assert a == block_keys("base", "t", list(TOKENS), 32)
    # a longer prompt shares the keys of the full blocks it has in common
    b = block_keys("base", "t", TOKENS + [9] * 30, 32)
    assert [k.key for k in b[:2]] == [k.key for k in a[:2]]
    assert b[2].key != a[2].key  # now a full block, not the 6-token partial one


def test_module_id_and_tenant_salt_separate_keys():
    base = {k.key for k in block_keys("base", "t", TOKENS, 32)}
    assert base.isdisjoint(k.key for k in block_keys("other-base", "t", TOKENS, 32))
    assert base.isdisjoint(k.key for k in block_keys("base", "u", TOKENS, 32))
    assert base.isdisjoint(k.key for k in block_keys("base", None, TOKENS, 32))


def test_change_in_a_block_changes_it_and_every_later_key():
    changed = list(TOKENS)
    changed[40] += 1
    a, b = block_keys("base", "t", TOKENS, 32), block_keys("base", "t", changed, 32)
    assert a[0].key == b[0].key
    assert a[1].key != b[1].key and a[2].key != b[2].key


def test_shared_keys_follow_the_hand_over_convention():
    keys = shared_block_keys("base", "t", TOKENS, 32)
    assert sum(k.num_tokens for k in keys) == len(TOKENS) - 1
    assert keys == block_keys("base", "t", TOKENS[:-1], 32)
    # a prompt of 65 tokens shares exactly 2 full blocks and no partial one
    assert [k.full for k in shared_block_keys("base", "t", TOKENS[:65], 32)] == [True, True]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="prefill_module_id"):
        block_keys("", "t", TOKENS, 32)
    with pytest.raises(ValueError, match="block_size"):
        block_keys("base", "t", TOKENS, 0)
    with pytest.raises(ValueError):
        shared_block_keys("base", "t", [], 32)


def test_adapter_salt_separates_adapters_and_keeps_plain_keys():
    assert key_salt("t") == "t" and key_salt(None) is None
    plain = {k.key for k in block_keys("base", key_salt("t"), TOKENS, 32)}
    a = {k.key for k in block_keys("base", key_salt("t", "lora-a"), TOKENS, 32)}
    b = {k.key for k in block_keys("base", key_salt("t", "lora-b"), TOKENS, 32)}
    assert plain.isdisjoint(a) and a.isdisjoint(b)
    # the tenant still separates keys of one adapter
    assert a.isdisjoint(k.key for k in block_keys("base", key_salt("u", "lora-a"), TOKENS, 32))
