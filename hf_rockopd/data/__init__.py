"""Any dataset in TRL's formats, found the way models are found: `resolve` (a local copy first, the Hub last),
`formats` (which columns hold the prompt and the reference), `problems` (held-out problems and training prompts);
`chat` (chat messages and JSON lines) and `gsm8k` (GSM8K's held-out problems) are imported by their own path.

Example:
```python
from hf_rockopd.data import load_problems, split_dataset

problems = load_problems("HuggingFaceH4/MATH-500", split="test", limit=32)
data = split_dataset("openai/gsm8k", num_train=256, num_eval=16, seed=42, eval_dataset=None)
```
"""

from .formats import (
    ANSWER_COLUMNS,
    FORMATS,
    QUESTION_COLUMNS,
    DataColumns,
    detect_columns,
    row_problem,
    row_training_messages,
)
from .problems import DataSplit, load_dataset_columns, load_problems, split_dataset
from .resolve import (
    DATA_DIR_ENV,
    DEFAULT_CONFIGS,
    ResolvedDataset,
    dataset_folder_names,
    load_data_file,
    resolve_dataset,
)

__all__ = [
    "ANSWER_COLUMNS",
    "DATA_DIR_ENV",
    "DEFAULT_CONFIGS",
    "FORMATS",
    "QUESTION_COLUMNS",
    "DataColumns",
    "DataSplit",
    "ResolvedDataset",
    "dataset_folder_names",
    "detect_columns",
    "load_data_file",
    "load_dataset_columns",
    "load_problems",
    "resolve_dataset",
    "row_problem",
    "row_training_messages",
    "split_dataset",
]
