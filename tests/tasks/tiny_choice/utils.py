import datasets

DOCS = [
    {"question": "the cat sat on the", "choices": [" mat", " dog"], "answer": 0},
    {"question": "one two three", "choices": [" four", " cat"], "answer": 0},
    {"question": "Mary and John went to the", "choices": [" drink", " store"], "answer": 1},
    {"question": "five plus two equals", "choices": [" seven", " the"], "answer": 0},
]


def load_docs(**kwargs) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(DOCS)})
