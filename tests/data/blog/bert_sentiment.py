"""Seed 000's BERT sentiment classifier, the part that trains with transformers' Trainer, as a user of the blog runs it,
on phalanx: the only change to the blog's code is the import of Trainer and TrainingArguments.

Nothing can be downloaded here, so tests/test_blog_bert.py generates what the blog downloads: ``./model`` (a tiny BERT
and its tokenizer, saved with save_pretrained, dropout off) and ``./ChnSentiCorp_htl_all.csv`` (short hotel reviews).
The blog builds ``tokenized_datasets`` and ``eval_metric`` in an earlier post; here they come from its own dataset code
(pandas, ``random_split``), with the split seeded (every rank must draw the same one; an unseeded split differs per
process, under transformers as under phalanx), and the metrics are computed with numpy (``evaluate.load`` downloads).
"""

import pandas as pd
import torch
from torch.utils.data import Dataset, random_split
from transformers import BertForSequenceClassification, BertTokenizer, DataCollatorWithPadding

from phalanx import Trainer, TrainingArguments  # the blog: from transformers import Trainer, TrainingArguments


class MyDataset(Dataset):
    def __init__(self) -> None:
        super().__init__()
        self.data = pd.read_csv("./ChnSentiCorp_htl_all.csv")
        self.data = self.data.dropna()

    def __getitem__(self, index):
        return self.data.iloc[index]["review"], self.data.iloc[index]["label"]

    def __len__(self):
        return len(self.data)


dataset = MyDataset()
trainset, validset = random_split(dataset, lengths=[0.9, 0.1], generator=torch.Generator().manual_seed(42))

tokenizer = BertTokenizer.from_pretrained("./model")
model = BertForSequenceClassification.from_pretrained("./model")


def process_function(item):
    review, label = item
    tokenized = tokenizer(review, max_length=128, truncation=True)
    tokenized["labels"] = int(label)
    return tokenized


tokenized_datasets = {"train": [process_function(x) for x in trainset], "test": [process_function(x) for x in validset]}


def eval_metric(eval_predict):
    predictions, labels = eval_predict
    predictions = predictions.argmax(axis=-1)
    acc = float((predictions == labels).mean())
    tp = float(((predictions == 1) & (labels == 1)).sum())
    f1 = 2 * tp / max(1.0, float((predictions == 1).sum() + (labels == 1).sum()))
    return {"accuracy": acc, "f1": f1}


# The blog's Trainer, argument for argument, as the blog lays it out.
# fmt: off
train_args = TrainingArguments(output_dir="./checkpoints",      # 输出文件夹
                               per_device_train_batch_size=64,  # 训练时的batch_size
                               per_device_eval_batch_size=128,  # 验证时的batch_size
                               logging_steps=10,                # log 打印的频率
                               evaluation_strategy="epoch",     # 评估策略
                               save_strategy="epoch",           # 保存策略
                               save_total_limit=3,              # 最大保存数
                               learning_rate=2e-5,              # 学习率
                               weight_decay=0.01,               # weight_decay
                               metric_for_best_model="f1",      # 设定评估指标
                               load_best_model_at_end=True)     # 训练完成后加载最优模型
trainer = Trainer(model=model,
                  args=train_args,
                  train_dataset=tokenized_datasets["train"],
                  eval_dataset=tokenized_datasets["test"],
                  data_collator=DataCollatorWithPadding(tokenizer=tokenizer),
                  compute_metrics=eval_metric)
# fmt: on
trainer.train()
