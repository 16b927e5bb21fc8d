"""What `starjar models build` measures once on a new pair: how often the target accepts the draft's tokens.

Greedy, gamma 3, prompts of our own (no data set needed), through the chat template. The figure is kept
in the draft's starjar.json, so later builds print it without measuring again.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

OWN_PROMPTS = [
    "Explain how a hash map handles collisions, with a short Python example.",
    "Write a haiku about autumn rain, then explain its imagery.",
    "List five tips for a first job interview and say why each matters.",
    "What is the difference between weather and climate? Answer for a ten-year-old.",
    "Summarize the plot of Romeo and Juliet in four sentences.",
    "Convert 72 degrees Fahrenheit to Celsius and show the formula.",
]
GAMMA = 3
KEY = "measured"


def measured_acceptance(target_dir: str, draft_dir: str, force: bool = False, max_new: int = 32) -> dict:
    recipe_path = Path(draft_dir) / "starjar.json"
    recipe = json.loads(recipe_path.read_text()) if recipe_path.is_file() else {}
    if KEY in recipe and not force:
        return recipe[KEY]
    from controller.colocated import colocated_engine, load_pair
    from starjar.sampling import SamplingParams
    from starjar.text import encode_prompt

    print(f"measuring the draft's acceptance (gamma {GAMMA}, {len(OWN_PROMPTS)} prompts, greedy) ...",
          file=sys.stderr)
    target, draft = load_pair(target_dir, draft_dir)
    eng = colocated_engine(target, draft, GAMMA, len(OWN_PROMPTS))
    eng.generate([encode_prompt(target.tokenizer, p, chat=True) for p in OWN_PROMPTS],
                 SamplingParams(max_tokens=max_new))
    result = {"acceptance_rate": round(eng.stats.acceptance_rate, 3), "gamma": GAMMA, "prompts": len(OWN_PROMPTS),
              "drafted_tokens": eng.stats.drafted_tokens}
    recipe[KEY] = result
    recipe_path.write_text(json.dumps(recipe))
    return result
