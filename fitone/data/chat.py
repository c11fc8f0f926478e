"""Chat `messages` rows: checked, rendered by the tokenizer's chat template, the loss on the assistant turns."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fitone.data.examples import IGNORE_INDEX
from fitone.errors import DataError

MESSAGES_FIELD = "messages"


def chat_tokenizer(tokenizer, template_file: str | None, source: str) -> None:
    """Give the tokenizer --chat-template's template (exported with it in final/); refuse chat data without one."""
    if template_file:
        tokenizer.chat_template = Path(template_file).read_text(encoding="utf-8")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"{source} holds chat '{MESSAGES_FIELD}' rows but the model's tokenizer has no chat template: "
                        "give one with --chat-template FILE.jinja")


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def check_chat(table, source: str) -> None:
    """Every conversation is a list of {role, content} messages with text values and a known role; the first
    row that is not is named (a misspelled 'assistant' would otherwise train on nothing)."""
    for i, messages in _suspect_conversations(table):
        problem = _conversation_problem(messages)
        if problem:
            raise DataError(f"{source}: example {i + 1}: {problem}")


def _suspect_conversations(table) -> Iterator[tuple[int, Any]]:
    """(row, conversation) of the rows that may be wrong. Where every message has the same text fields, Arrow
    finds the first such row column by column and only it is read; other shapes (datasets' Json type, for
    messages with different keys) are read row by row."""
    import pyarrow as pa
    import pyarrow.compute as pc

    column = table.data.column(MESSAGES_FIELD)
    item = getattr(column.type, "value_type", None)
    if not (item is not None and pa.types.is_struct(item) and all(
            item.get_field_index(key) >= 0 and item.field(key).type in (pa.string(), pa.large_string())
            for key in ("role", "content"))):
        for start, batch in enumerate(table.select_columns([MESSAGES_FIELD]).iter(batch_size=1000)):
            yield from enumerate(batch[MESSAGES_FIELD], start * 1000)
        return
    start = 0
    for chunk in column.chunks:
        messages = pc.list_flatten(chunk)
        roles = pc.struct_field(messages, "role")
        bad = pc.or_(pc.or_(pc.is_null(roles), pc.is_null(pc.struct_field(messages, "content"))),
                     pc.invert(pc.fill_null(pc.is_in(roles, value_set=pa.array(CHAT_ROLES)), True)))
        at = pc.index(bad, True).as_py()
        rows = [r for r in (pc.index(pc.is_null(chunk), True).as_py(),
                            pc.list_parent_indices(chunk)[at].as_py() if at >= 0 else -1) if r >= 0]
        if rows:
            yield start + min(rows), chunk[min(rows)].as_py()
        start += len(chunk)


def _conversation_problem(messages: Any) -> str | None:
    shape = f"'{MESSAGES_FIELD}' must be a list of {{role, content}} objects with text values"
    if not isinstance(messages, list):
        return f"{shape}; got {str(messages)[:60]}"
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return f"{shape}; got {str(m)[:60]}"
        if m["role"] not in CHAT_ROLES:
            near = difflib.get_close_matches(m["role"], CHAT_ROLES, n=1)
            return (f"unknown chat role {m['role']!r} (" + (f"did you mean {near[0]!r}? " if near else "")
                    + f"the roles are {', '.join(CHAT_ROLES)}): fix the row's role")
    return None


def render_chat(messages: list[dict[str, str]], tokenizer) -> tuple[list[int], list[int]]:
    """input_ids of the conversation (checked by check_chat) rendered by the chat template, and labels that
    are those ids inside the assistant turns and IGNORE_INDEX elsewhere.

    An assistant turn's text is what rendering messages[:k+1] adds to messages[:k] with the generation
    prompt (so its end-of-turn marker is learnt, the role header is not). The rendered text is tokenised
    piece by piece at those boundaries, which chat templates mark with special tokens."""
    def render(part: list[dict[str, str]], prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(part, tokenize=False, add_generation_prompt=prompt)

    full, pieces, at = render(messages), [], 0
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:k], prompt=True), render(messages[: k + 1])
        if not (full.startswith(through) and through.startswith(before) and len(before) >= at):
            raise DataError("the chat template renders earlier turns differently once later turns follow, so the "
                            "assistant turns cannot be found: give a --chat-template FILE that renders each turn "
                            "the same way wherever it stands")
        pieces += [(full[at:len(before)], False), (full[len(before):len(through)], True)]
        at = len(through)
    pieces.append((full[at:], False))
    ids: list[int] = []
    labels: list[int] = []
    for text, learn in pieces:
        if text:
            part = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += part
            labels += part if learn else [IGNORE_INDEX] * len(part)
    return ids, labels
