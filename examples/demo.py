"""`make demo`: an lmnb program on the embedded SmolLM2-135M-Instruct (CPU unless a GPU is present).

It asks a question, checks the answer with `select`, forks two follow-ups that share the cached
conversation, and ends with a JSON answer constrained by a schema.
"""

import json

import lmnb
from lmnb import assistant, gen, select, system, user

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                         "country": {"type": "string", "maxLength": 20}},
        "required": ["city", "country"]}


@lmnb.function
def capital(s, country):
    s += system("You are a concise assistant.")
    s += user(f"What is the capital of {country}?")
    s += assistant(gen("answer", max_tokens=24))
    s += user("Is that answer correct? Say yes or no.")
    s += assistant(select("correct", ["yes", "no"]))
    forks = s.fork(2)
    forks += [user("Name one famous landmark there."), user("Name one food it is known for.")]
    forks += assistant(gen("detail", max_tokens=24))
    forks.join()
    s += user("Give the city and the country as JSON.")
    s += assistant(gen("json", max_tokens=40, json_schema=CITY))


def main() -> None:
    with lmnb.Runtime() as rt:
        state = capital.run(country="France", temperature=0, backend=rt)
        print("answer:  ", state["answer"].strip())
        print("correct: ", state["correct"])
        for name, detail in zip(("landmark", "food"), state["detail"], strict=True):
            print(f"{name + ':':9} {detail.strip()}")
        print("json:    ", json.loads(state["json"]))
        stats = rt.stats()
        print(f"[{stats['prompt_tokens']} prompt tokens, {stats['cached_tokens']} served from the "
              f"radix cache, {stats['generated_tokens']} generated]")


if __name__ == "__main__":
    main()
