"""lm-evaluation-harness hooks of the task YAMLs `ddiloco.posttrain.lmeval` writes (copied beside them as
`utils.py`, where their `!function utils.process_results` finds it)."""


def process_results(doc, results):
    """Exact match as `ddiloco.posttrain.tasks.exact_match` scores it: the greedy continuation starts with
    the answer, and the answer is not the start of a longer word or number."""
    generated, answer = results[0], doc["answer"]
    rest = generated[len(answer) :]
    return {"exact_match": float(generated.startswith(answer) and (not rest or not rest[0].isalnum()))}
