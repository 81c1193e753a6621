"""Reasoning separation (SGLang's `separate_reasoning`): a reasoning model's output split into its
thinking part and the rest.

    s += assistant(separate_reasoning(gen("answer"), model_type="deepseek-r1"))
    state["answer"]                      # the text after "</think>"
    state["answer_reasoning_content"]    # the text inside <think>...</think>

Each model type names its markers and whether the output starts inside the reasoning without an
opening marker (DeepSeek-R1 writes no "<think>": everything before "</think>" is reasoning). The
split follows SGLang's non-streaming reasoning parser: start markers are dropped and the text
stripped, as is the answer ("<think>\nA\n</think>\n\nB" -> reasoning "A\n", answer "B"); with no
end marker the whole output is reasoning (cut off while thinking); an output that never enters
reasoning is all answer, unstripped, with an empty reasoning part.
"""

from __future__ import annotations

from dataclasses import dataclass

REASONING_SUFFIX = "_reasoning_content"


@dataclass(frozen=True)
class ReasoningFormat:
    start: str
    end: str
    starts_in_reasoning: bool  # SGLang's force_reasoning: no start marker is written

    def split(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) of one output."""
        if not (self.starts_in_reasoning or self.start in text):
            return "", text
        text = text.replace(self.start, "").strip()
        reasoning, found, answer = text.partition(self.end)
        return (reasoning, answer.strip()) if found else (text, "")


_THINK = ("<think>", "</think>")
FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(*_THINK, starts_in_reasoning=True),
    "step3": ReasoningFormat(*_THINK, starts_in_reasoning=True),
    "qwen3": ReasoningFormat(*_THINK, starts_in_reasoning=False),
    "qwen3-thinking": ReasoningFormat(*_THINK, starts_in_reasoning=True),
    "minimax": ReasoningFormat(*_THINK, starts_in_reasoning=True),
    "interns1": ReasoningFormat(*_THINK, starts_in_reasoning=False),
    "glm45": ReasoningFormat(*_THINK, starts_in_reasoning=False),
    "kimi": ReasoningFormat("◁think▷", "◁/think▷", starts_in_reasoning=False),
}


def reasoning_format(model_type: str | None) -> ReasoningFormat:
    """The format of `model_type` (case-insensitive); ValueError for one not known here."""
    if not model_type:
        raise ValueError("separate_reasoning needs a model_type, e.g. 'deepseek-r1' or 'qwen3'")
    found = FORMATS.get(model_type.lower())
    if found is None:
        raise ValueError(f"unsupported reasoning model_type {model_type!r}; lmnb knows "
                         f"{sorted(FORMATS)}")
    return found


def reasoning_name(name: str | None) -> str:
    """The variable that receives the reasoning of variable `name` (SGLang's naming)."""
    if not name:
        raise ValueError("separate_reasoning needs a named gen or select: the reasoning goes to "
                         "the variable NAME + '_reasoning_content'")
    return name + REASONING_SUFFIX


def split_reasoning(value: str | list[str], model_type: str) -> tuple[str | list[str],
                                                                     str | list[str]]:
    """(answer, reasoning) of a gen's value; per sample for `n > 1` (a list)."""
    fmt = reasoning_format(model_type)
    if isinstance(value, list):
        pairs = [fmt.split(text) for text in value]
        return [answer for _, answer in pairs], [reasoning for reasoning, _ in pairs]
    reasoning, answer = fmt.split(value)
    return answer, reasoning
