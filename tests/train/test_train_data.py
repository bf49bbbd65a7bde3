"""`load_dataset` and the two dataset kinds it builds."""

from __future__ import annotations

import json

import pytest
import torch

from vllm_prove.train.data import ExampleDataset, StreamDataset, load_dataset

EOS = 0


class _ByteTokenizer:
    """One token per character (its code point), EOS = 0: expected ids are readable by hand."""

    eos_token_id = EOS

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        assert add_special_tokens is False  # the loaders must not add BOS/EOS of their own
        return {"input_ids": [ord(c) for c in text]}


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")  # a trailing blank line is fine
    return path


def test_train_jsonl_prompt_response_supervises_the_response_only(tmp_path):
    path = _write_jsonl(tmp_path / "sft.jsonl", [{"prompt": "ab", "response": "cde"},
                                                 {"prompt": "wxyz", "response": "uvwxyz"}])
    ds = load_dataset(path, _ByteTokenizer(), seq_len=8)
    assert isinstance(ds, ExampleDataset)
    # row 0: prompt + response + EOS, right-padded with EOS; row 1 truncated to seq_len
    assert ds.input_ids.tolist() == [_ids("abcde") + [EOS, EOS, EOS], _ids("wxyzuvwx")]
    assert ds.response_mask.int().tolist() == [[0, 0, 1, 1, 1, 1, 0, 0],  # the response's EOS is learnt,
                                               [0, 0, 0, 0, 1, 1, 1, 1]]  # padding is not
    batch = ds.sample(5, torch.Generator().manual_seed(0))
    assert batch.input_ids.shape == batch.response_mask.shape == (5, 8)
    assert batch.response_mask.dtype == torch.bool
    for ids, mask in zip(batch.input_ids, batch.response_mask):  # rows stay paired with their masks
        row = ds.input_ids.tolist().index(ids.tolist())
        assert torch.equal(mask, ds.response_mask[row])


def test_train_jsonl_text_is_one_stream_fully_supervised(tmp_path):
    path = _write_jsonl(tmp_path / "plain.jsonl", [{"text": "hello"}, {"text": "world!"}])
    ds = load_dataset(path, _ByteTokenizer(), seq_len=4)
    assert isinstance(ds, StreamDataset)
    stream = _ids("hello") + [EOS] + _ids("world!") + [EOS]
    assert ds.token_ids.tolist() == stream
    batch = ds.sample(16, torch.Generator().manual_seed(0))
    assert bool(batch.response_mask.all())
    windows = {tuple(stream[i : i + 4]) for i in range(len(stream) - 4 + 1)}
    assert all(tuple(row) in windows for row in batch.input_ids.tolist())


def test_train_folder_of_txt_files_is_read_in_name_order(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.txt").write_text("third")
    (tmp_path / "weights.bin").write_text("not text")  # not a text suffix: skipped
    ds = load_dataset(tmp_path, _ByteTokenizer(), seq_len=4)
    assert isinstance(ds, StreamDataset)
    assert ds.token_ids.tolist() == _ids("first") + [EOS] + _ids("second") + [EOS] + _ids("third") + [EOS]


def test_train_single_text_file(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("abcdef")
    ds = load_dataset(path, _ByteTokenizer(), seq_len=3)
    assert ds.token_ids.tolist() == _ids("abcdef") + [EOS]


@pytest.mark.parametrize("rows", [
    [{"question": "q", "answer": "a"}],
    [{"prompt": "only a prompt"}],
    [{"prompt": "p", "response": "r"}, {"text": "mixed kinds"}],
])
def test_train_jsonl_without_known_fields_is_a_clear_error(tmp_path, rows):
    path = _write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=r"bad\.jsonl: every row needs `prompt` and `response`, or `text`"):
        load_dataset(path, _ByteTokenizer(), seq_len=8)


def test_train_empty_inputs_are_clear_errors(tmp_path):
    (tmp_path / "notes.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no"):
        load_dataset(tmp_path, _ByteTokenizer(), seq_len=8)
    with pytest.raises(ValueError, match="stream of 7 tokens is shorter than seq_len=8"):
        StreamDataset(torch.arange(7), seq_len=8)
    one_window = StreamDataset(torch.arange(8), seq_len=8).sample(3, torch.Generator().manual_seed(0))
    assert one_window.input_ids.tolist() == [list(range(8))] * 3
    with pytest.raises(ValueError, match="no training examples"):
        ExampleDataset([], seq_len=8, pad_id=EOS)


def test_train_stream_windows_reach_the_end_of_the_stream():
    """Every start 0..N-seq is drawn, so the last token is trainable too."""
    ds = StreamDataset(torch.arange(10), seq_len=4)
    batch = ds.sample(2000, torch.Generator().manual_seed(0))
    assert batch.input_ids.shape == (2000, 4)
    assert torch.equal(batch.input_ids - batch.input_ids[:, :1], torch.arange(4).expand(2000, -1))
    assert set(batch.input_ids[:, 0].tolist()) == set(range(10 - 4 + 1))


def test_train_grouped_examples_share_a_prompt_length_and_carry_no_padding_column():
    examples = [([1] * n, [2] * r) for n, r in ((3, 5), (3, 2), (6, 4), (6, 1), (3, 4))] * 4
    ds = ExampleDataset(examples, seq_len=12, pad_id=0, group_by_prompt=True)
    gen = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(40):
        b = ds.sample(3, gen)
        prompt_lens = (~b.response_mask & b.valid_mask).sum(dim=1)
        assert prompt_lens.unique().numel() == 1
        assert b.valid_mask[:, -1].any()  # cut to the longest row
        seen.add(int(prompt_lens[0]))
    assert seen == {3, 6}
    ungrouped = ExampleDataset(examples, seq_len=12, pad_id=0)
    assert ungrouped.sample(3, gen).input_ids.shape[1] == 12
