"""Reasoning models' thinking, apart from their answer: `<think>...</think>` goes to the reply's
`reasoning_content` (vLLM's `--reasoning-parser` names and behaviour), streamed or whole alike.

- "qwen3": the model opens `<think>` itself; a reply that does not start with it has no reasoning
  (Qwen3 with `chat_template_kwargs: {"enable_thinking": false}`: the template closed an empty block).
- "deepseek_r1": the template's generation prompt opened `<think>` (DeepSeek-R1 and its distills);
  the reply is reasoning until `</think>` (a `<think>` the model repeats is dropped), all of it when
  it never closes.

gpt-oss ("gpt-oss", HARMONY) writes channels, not `<think>`: brisk.structured.harmony reads those.
"""

from __future__ import annotations

THINK, END_THINK = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")
HARMONY = "gpt-oss"  # gpt-oss's harmony channels: brisk.structured.harmony, not a <think> splitter


class ReasoningSplitter:
    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser {parser!r}: expected one of {', '.join(PARSERS)}")
        self.parser = parser
        self._state = "start"  # -> "reasoning" -> "after_think" -> "answer"
        self._held = ""
        self.reasoning = ""
        self.answer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) text safe to send now."""
        reasoning, answer = [], []
        self._held += text
        while self._held:
            if self._state == "start":
                if not self._open():
                    break
            elif self._state == "reasoning":
                self._reason(reasoning)
                if self._state == "reasoning":
                    break
            elif self._state == "after_think":  # the newlines after </think> are not part of the answer
                self._held = self._held.lstrip("\n")
                if self._held:
                    self._state = "answer"
            else:
                answer.append(self._held)
                self._held = ""
        return self._record("".join(reasoning), "".join(answer))

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state in ("answer", "after_think") or (self._state == "start" and self.parser == "qwen3"):
            return self._record("", held)
        return self._record(held, "")

    def _open(self) -> bool:
        """At the start: decide whether the reply opens with reasoning. False: wait for more text."""
        stripped = self._held.lstrip()
        if stripped.startswith(THINK):
            self._held = stripped[len(THINK):]
            self._state = "reasoning"
            return True
        if THINK.startswith(stripped):
            return False  # whitespace, or a part of "<think>"
        self._state = "reasoning" if self.parser == "deepseek_r1" else "answer"
        return True

    def _reason(self, reasoning: list[str]) -> None:
        at = self._held.find(END_THINK)
        if at != -1:
            reasoning.append(self._held[:at])
            self._held = self._held[at + len(END_THINK):]
            self._state = "after_think"
            return
        keep = next((n for n in range(min(len(END_THINK) - 1, len(self._held)), 0, -1)
                     if self._held.endswith(END_THINK[:n])), 0)
        reasoning.append(self._held[:len(self._held) - keep])
        self._held = self._held[len(self._held) - keep:]

    def _record(self, reasoning: str, answer: str) -> tuple[str, str]:
        self.reasoning += reasoning
        self.answer += answer
        return reasoning, answer
