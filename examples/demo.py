"""Ask the embedded SmolLM2-135M-Instruct one question, greedily (`make demo`)."""

import lmnb

QUESTION = "What is the capital of France?"


def main() -> None:
    rt = lmnb.Runtime()  # embedded default model; CPU unless a GPU is present
    try:
        prompt = rt.tokenizer.apply_chat_template(
            [{"role": "user", "content": QUESTION}], tokenize=False, add_generation_prompt=True
        )
        out = rt.generate(prompt, {"max_new_tokens": 48, "temperature": 0})
        meta = out["meta_info"]
        print(f"Q: {QUESTION}")
        print(f"A: {out['text'].strip()}")
        print(
            f"[prompt tokens: {meta['prompt_tokens']}, "
            f"completion tokens: {meta['completion_tokens']}]"
        )
    finally:
        rt.close()


if __name__ == "__main__":
    main()
