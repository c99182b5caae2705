"""Regenerates data/demo_conversations.jsonl (committed): small, deterministic, mixed shapes.

Half the records use the OpenAI `messages` shape, half the ShareGPT `conversations` shape;
some have a system prompt and several turns, so loss masks cover more than one span.
"""

import json
import random
from pathlib import Path

TOPICS = {
    "rivers": ["The Nile flows north into the Mediterranean.", "The Amazon carries the most water of any river.",
               "The Danube crosses ten countries.", "The Mississippi drains much of North America."],
    "cooking": ["Bread rises because yeast makes carbon dioxide.", "Salt draws water out of vegetables.",
                "Pasta should be cooked in plenty of salted water.", "Rice needs about twice its volume of water."],
    "computers": ["A cache keeps recent data close to the processor.", "A compiler turns source code into machine code.",
                  "A hash table finds keys in constant expected time.", "A GPU runs many threads in parallel."],
    "space": ["The Moon orbits the Earth every 27 days.", "Mars has two small moons.",
              "Jupiter is the largest planet in the solar system.", "Light from the Sun takes about eight minutes to reach us."],
}
QUESTIONS = ["Tell me something about {t}.", "What is a fact about {t}?", "Explain one thing about {t}.",
             "Can you share a short note on {t}?"]
FOLLOWUPS = ["Tell me more.", "Why is that?", "Give another example.", "Can you say it differently?"]


def conversation(rng: random.Random) -> list[dict]:
    topic = rng.choice(sorted(TOPICS))
    facts = TOPICS[topic][:]
    rng.shuffle(facts)
    msgs = []
    if rng.random() < 0.3:
        msgs.append({"role": "system", "content": "You are a concise assistant."})
    msgs.append({"role": "user", "content": rng.choice(QUESTIONS).format(t=topic)})
    for turn in range(rng.randint(1, 3)):
        reply = " ".join(facts[: rng.randint(1, 3)])
        if rng.random() < 0.5:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            reply += f" Also, {a} plus {b} is {a + b}."
        msgs.append({"role": "assistant", "content": reply})
        rng.shuffle(facts)
        if turn < 2 and rng.random() < 0.6:
            msgs.append({"role": "user", "content": rng.choice(FOLLOWUPS)})
        else:
            break
    if msgs[-1]["role"] == "user":
        msgs.append({"role": "assistant", "content": facts[0]})
    return msgs


def main(n: int = 240, seed: int = 0) -> None:
    rng = random.Random(seed)
    out = Path(__file__).with_name("demo_conversations.jsonl")
    with out.open("w") as f:
        for i in range(n):
            msgs = conversation(rng)
            if i % 2:
                rec = {"id": f"demo-{i:04d}", "conversations": [
                    {"from": {"user": "human", "assistant": "gpt", "system": "system"}[m["role"]], "value": m["content"]}
                    for m in msgs]}
            else:
                rec = {"id": f"demo-{i:04d}", "messages": msgs}
            f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
