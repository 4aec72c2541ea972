import datasets

DOCS = [
    {"context": "the cat sat", "target": " on"},
    {"context": "the cat", "target": " sat on"},
    {"context": "Mary and John went", "target": " to"},
    {"context": "Mary and John went to the", "target": " store"},
    {"context": "one two three", "target": " four"},
]


def load_docs(**kwargs) -> datasets.DatasetDict:
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(DOCS)})
