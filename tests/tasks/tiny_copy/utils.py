import datasets

WORDS = "the cat sat on mat when Mary and John went to store gave drink".split()


def load_docs(**kwargs) -> datasets.DatasetDict:
    docs = []
    for i in range(12):
        seq = [WORDS[(i * 3 + j * 5) % len(WORDS)] for j in range(5)]
        docs.append({"context": " ".join(seq + seq[:2]), "target": " " + seq[2]})
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})
