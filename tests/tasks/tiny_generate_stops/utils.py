def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"answer_chars": float(len(results[0]))}
