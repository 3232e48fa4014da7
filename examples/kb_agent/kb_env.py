"""A user-written multi-tool environment: questions over a small knowledge base with unit conversion.

Everything trajgrad needs is in this file: two plain Python tools (type hints and a
docstring make their schemas), a task list, a scorer, and demonstrations for a warm start.
Train it with ``task.name: "kb_env:KBSource"`` (this directory on ``PYTHONPATH``).

A question asks for one fact, sometimes in another unit::

    user:      How tall is Mont Blanc in feet?
    assistant: <tool_call>{"name": "lookup", "arguments": {"entity": "Mont Blanc", "attribute": "height_m"}}</tool_call>
    tool:      4806
    assistant: <tool_call>{"name": "convert", "arguments": {"value": 4806, "from_unit": "m", "to_unit": "ft"}}</tool_call>
    tool:      15767.7
    assistant: 15768

The final reply (a turn without a tool call) scores 1 when it holds the right value
(within 0.5% for numbers; the name for countries), else 0.
"""
from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass
from typing import List, Literal, Optional

from trajgrad.envs import Task, ToolEnv, format_tool_call

KB = {
    "Mont Blanc": {"kind": "mountain", "height_m": 4806, "country": "France"},
    "Matterhorn": {"kind": "mountain", "height_m": 4478, "country": "Switzerland"},
    "Denali": {"kind": "mountain", "height_m": 6190, "country": "USA"},
    "Kilimanjaro": {"kind": "mountain", "height_m": 5895, "country": "Tanzania"},
    "Aconcagua": {"kind": "mountain", "height_m": 6961, "country": "Argentina"},
    "Elbrus": {"kind": "mountain", "height_m": 5642, "country": "Russia"},
    "Fuji": {"kind": "mountain", "height_m": 3776, "country": "Japan"},
    "Olympus": {"kind": "mountain", "height_m": 2917, "country": "Greece"},
    "Rhine": {"kind": "river", "length_km": 1233, "country": "Germany"},
    "Danube": {"kind": "river", "length_km": 2850, "country": "Germany"},
    "Loire": {"kind": "river", "length_km": 1006, "country": "France"},
    "Thames": {"kind": "river", "length_km": 346, "country": "England"},
    "Nile": {"kind": "river", "length_km": 6650, "country": "Egypt"},
    "Volga": {"kind": "river", "length_km": 3530, "country": "Russia"},
    "Mekong": {"kind": "river", "length_km": 4909, "country": "China"},
    "Tiber": {"kind": "river", "length_km": 406, "country": "Italy"},
    # 48 more (``entities: 64``): questions about 64 entities give a held-out split of 64 or more
    "Everest": {"kind": "mountain", "height_m": 8849, "country": "Nepal"},
    "K2": {"kind": "mountain", "height_m": 8611, "country": "Pakistan"},
    "Kangchenjunga": {"kind": "mountain", "height_m": 8586, "country": "Nepal"},
    "Nanga Parbat": {"kind": "mountain", "height_m": 8126, "country": "Pakistan"},
    "Mount Kenya": {"kind": "mountain", "height_m": 5199, "country": "Kenya"},
    "Aoraki": {"kind": "mountain", "height_m": 3724, "country": "New Zealand"},
    "Kosciuszko": {"kind": "mountain", "height_m": 2228, "country": "Australia"},
    "Etna": {"kind": "mountain", "height_m": 3357, "country": "Italy"},
    "Vesuvius": {"kind": "mountain", "height_m": 1281, "country": "Italy"},
    "Zugspitze": {"kind": "mountain", "height_m": 2962, "country": "Germany"},
    "Grossglockner": {"kind": "mountain", "height_m": 3798, "country": "Austria"},
    "Mulhacen": {"kind": "mountain", "height_m": 3479, "country": "Spain"},
    "Teide": {"kind": "mountain", "height_m": 3715, "country": "Spain"},
    "Ben Nevis": {"kind": "mountain", "height_m": 1345, "country": "Scotland"},
    "Snowdon": {"kind": "mountain", "height_m": 1085, "country": "Wales"},
    "Rainier": {"kind": "mountain", "height_m": 4392, "country": "USA"},
    "Whitney": {"kind": "mountain", "height_m": 4421, "country": "USA"},
    "Logan": {"kind": "mountain", "height_m": 5959, "country": "Canada"},
    "Chimborazo": {"kind": "mountain", "height_m": 6263, "country": "Ecuador"},
    "Huascaran": {"kind": "mountain", "height_m": 6768, "country": "Peru"},
    "Ararat": {"kind": "mountain", "height_m": 5137, "country": "Turkey"},
    "Damavand": {"kind": "mountain", "height_m": 5610, "country": "Iran"},
    "Toubkal": {"kind": "mountain", "height_m": 4167, "country": "Morocco"},
    "Kinabalu": {"kind": "mountain", "height_m": 4095, "country": "Malaysia"},
    "Amazon": {"kind": "river", "length_km": 6400, "country": "Brazil"},
    "Yangtze": {"kind": "river", "length_km": 6300, "country": "China"},
    "Mississippi": {"kind": "river", "length_km": 3730, "country": "USA"},
    "Yenisei": {"kind": "river", "length_km": 3487, "country": "Russia"},
    "Ob": {"kind": "river", "length_km": 3650, "country": "Russia"},
    "Lena": {"kind": "river", "length_km": 4400, "country": "Russia"},
    "Zambezi": {"kind": "river", "length_km": 2574, "country": "Zambia"},
    "Murray": {"kind": "river", "length_km": 2508, "country": "Australia"},
    "Ganges": {"kind": "river", "length_km": 2525, "country": "India"},
    "Indus": {"kind": "river", "length_km": 3180, "country": "Pakistan"},
    "Euphrates": {"kind": "river", "length_km": 2800, "country": "Iraq"},
    "Orinoco": {"kind": "river", "length_km": 2140, "country": "Venezuela"},
    "Parana": {"kind": "river", "length_km": 4880, "country": "Argentina"},
    "Colorado": {"kind": "river", "length_km": 2330, "country": "USA"},
    "Mackenzie": {"kind": "river", "length_km": 1738, "country": "Canada"},
    "Elbe": {"kind": "river", "length_km": 1094, "country": "Germany"},
    "Vistula": {"kind": "river", "length_km": 1047, "country": "Poland"},
    "Seine": {"kind": "river", "length_km": 777, "country": "France"},
    "Rhone": {"kind": "river", "length_km": 813, "country": "France"},
    "Po": {"kind": "river", "length_km": 652, "country": "Italy"},
    "Tagus": {"kind": "river", "length_km": 1007, "country": "Spain"},
    "Dnieper": {"kind": "river", "length_km": 2201, "country": "Ukraine"},
    "Shannon": {"kind": "river", "length_km": 360, "country": "Ireland"},
    "Irrawaddy": {"kind": "river", "length_km": 2170, "country": "Myanmar"},
}
_TO_BASE = {"m": 1.0, "ft": 0.3048, "km": 1000.0, "mi": 1609.344}


def lookup(entity: str, attribute: Literal["height_m", "length_km", "country"]) -> str:
    """Look up one attribute of a mountain or a river in the knowledge base.

    Args:
      entity: the name of the mountain or river, e.g. "Mont Blanc".
      attribute: "height_m" (mountains), "length_km" (rivers) or "country".
    """
    row = KB.get(entity)
    if row is None:
        raise KeyError(f"no entity named {entity!r}")
    if attribute not in row:
        raise KeyError(f"{entity} has no {attribute}; it has {', '.join(k for k in row if k != 'kind')}")
    return str(row[attribute])


def convert(value: float, from_unit: Literal["m", "ft", "km", "mi"], to_unit: Literal["m", "ft", "km", "mi"]) -> str:
    """Convert a length between metres, feet, kilometres and miles.

    Args:
      value: the length to convert.
      from_unit: its unit.
      to_unit: the unit wanted.
    """
    out = value * _TO_BASE[from_unit] / _TO_BASE[to_unit]
    return f"{out:.1f}"


@dataclass(frozen=True)
class KBConfig:
    """Options of :class:`KBSource` (``task.options``).

    Attributes:
      max_turns: assistant turns per episode (two tool calls and an answer need 3).
      units: ask for converted units too (two-tool questions) besides the stored ones.
      tool_listing: "json" (the tool schemas in the system prompt) or "brief" (one line each).
      heldout_fraction: share of the questions held out (by hash).
      entities: how many entities of the knowledge base the questions are about, in its order (1 to 64;
        the first 16 are the example's own; all 64 with ``heldout_fraction: 0.4`` hold out 64 or more
        distinct questions). The ``lookup`` tool knows all 64 either way.
    """

    max_turns: int = 3
    units: bool = True
    tool_listing: str = "json"
    heldout_fraction: float = 0.25
    entities: int = 16

    def __post_init__(self) -> None:
        if not (isinstance(self.entities, int) and 1 <= self.entities <= len(KB)):
            raise ValueError(f"task.options.entities: expected an integer from 1 to {len(KB)}, got {self.entities!r}")


def _questions(units: bool, entities: int = 16) -> List[dict]:
    out = []
    for name, row in sorted(list(KB.items())[:entities]):
        out.append({"q": f"Which country is {name} in?", "answer": row["country"], "entity": name,
                    "attribute": "country", "convert": None})
        attr, unit, other, word = (("height_m", "m", "ft", "tall") if row["kind"] == "mountain"
                                   else ("length_km", "km", "mi", "long"))
        plain = {"m": "metres", "km": "kilometres", "ft": "feet", "mi": "miles"}
        out.append({"q": f"How {word} is {name} in {plain[unit]}?", "answer": row[attr], "entity": name,
                    "attribute": attr, "convert": None})
        if units:
            value = row[attr] * _TO_BASE[unit] / _TO_BASE[other]
            out.append({"q": f"How {word} is {name} in {plain[other]}?", "answer": round(value, 1), "entity": name,
                        "attribute": attr, "convert": (unit, other)})
    return out


def _split(question: str, fraction: float) -> str:
    h = int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2.0**64
    return "heldout" if h < fraction else "train"


def score(answer_text: str, task: Task) -> float:
    """1.0 when the reply holds the right value, else 0.0."""
    truth = task.answer
    if isinstance(truth, str):
        return float(truth.lower() in answer_text.lower())
    m = re.search(r"-?\d[\d,]*(?:\.\d+)?", answer_text)
    if m is None:
        return 0.0
    value = float(m.group(0).replace(",", ""))
    return float(abs(value - truth) <= 0.005 * abs(truth) + 0.5)


class KBSource:
    """The task source: questions, the environment, demonstrations."""

    name = "kb"

    def __init__(self, **options) -> None:
        self.config = KBConfig(**options)

    def tasks(self, split: str, n: int, seed: int) -> List[Task]:
        pool = [q for q in _questions(self.config.units, self.config.entities) if _split(q["q"], self.config.heldout_fraction) == split]
        rng = random.Random(seed)
        out = []
        for k in range(n):
            if k % len(pool) == 0:
                rng.shuffle(pool)
            q = pool[k % len(pool)]
            out.append(Task(id=f"kb-{split}-{k}", split=split, prompt=q["q"], answer=q["answer"], metadata=dict(q)))
        return out

    def make_env(self, **kwargs) -> ToolEnv:
        return ToolEnv([lookup, convert], score, max_turns=self.config.max_turns,
                       system_prompt="Answer questions about mountains and rivers with the tools.",
                       tool_listing=self.config.tool_listing, max_turns_terminates=True, name="kb")

    def demonstration(self, task: Task) -> List[dict]:
        q = task.metadata
        value = lookup(q["entity"], q["attribute"])
        msgs = [{"role": "assistant", "content": format_tool_call("lookup", {"entity": q["entity"],
                                                                           "attribute": q["attribute"]})},
                {"role": "tool", "content": value}]
        if q["convert"] is not None:
            args = {"value": float(value), "from_unit": q["convert"][0], "to_unit": q["convert"][1]}
            value = convert(**args)
            msgs += [{"role": "assistant", "content": format_tool_call("convert", args)},
                     {"role": "tool", "content": value}]
        final = value if isinstance(task.answer, str) else str(round(float(value)))
        return msgs + [{"role": "assistant", "content": final}]


def heldout_success(source: Optional[KBSource] = None) -> float:  # pragma: no cover - a helper for the README
    """Share of held-out questions the demonstrations solve (1.0: the tools suffice)."""
    source = source or KBSource()
    tasks = source.tasks("heldout", 20, 0)
    return sum(score(source.demonstration(t)[-1]["content"], t) for t in tasks) / len(tasks)
