"""Each question's answer beside its own fixed-point and sink statistics, so
MECH's relation between stable stages and accuracy can be computed per
question (`data.answer_field`, `--mode=analyze` on a pretrained model).

The answer is greedy decoding at the model's R, up to
`analyze.answer_tokens` tokens, a blank line or a next "Question:" (cut
there); it is right when its last number equals the gold's (the number
after GSM8K's "####", else the gold's last number; commas and a trailing
".0" dropped from both), close to how lm-evaluation-harness's
"flexible-extract" reads GSM8K. The statistics come from the same
streamed pass as `fixed_points` and `stages`, per question: the read change
(worst layer, mean over the question's tokens) at R and at the deepest
iteration, the share of tokens whose read is within `analyze.tol` of the
last iterate's at R, and the attention mass on the first token at R and at
the deepest iteration (mean over layers and heads).
"""

import json
import re

import numpy as np
from etils import epath

from loopjax import sharding, storage
from loopjax.data import lm
from loopjax.lm.generate import generate

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def final_number(text: str) -> str | None:
  """The last number in `text`, commas and a trailing .0 dropped."""
  found = _NUMBER.findall(text)
  if not found:
    return None
  n = found[-1].replace(",", "")
  return n[:-2] if n.endswith(".0") else n


def gold(answer: str) -> str | None:
  """GSM8K's "#### 72", else the answer's last number."""
  return final_number(answer.split("####")[-1])


def per_question(ex: dict, R: int, tol: float) -> list[dict]:
  """The statistics of each row of the streamed pass's outputs `ex`."""
  fp, sink_BRLN = ex["fixed_points"], np.asarray(ex["attention"]["sink"])
  real_BT11 = np.asarray(fp["real"], np.float32)[:, :, None, None]

  def token_mean(x_BTIL):  # (B, I, L)
    return (x_BTIL * real_BT11).sum(1) / np.maximum(real_BT11.sum(1), 1)

  worst_BI = token_mean(np.asarray(fp["change"])).max(-1)  # entry i: iteration i + 2
  at = min(R, worst_BI.shape[1] + 1) - 2
  within_BTIL = (np.asarray(fp["to_last"])[:, :, at : at + 1] < tol).all(-1)[..., None]
  settled_B = token_mean(within_BTIL.astype(np.float32))[:, 0, 0]
  return [
    {
      "read_change_at_R": float(worst_BI[b, at]),
      "read_change_last": float(worst_BI[b, -1]),
      "settled_at_R": float(settled_B[b]),
      "sink_at_R": float(sink_BRLN[b, R - 1].mean()),
      "sink_last": float(sink_BRLN[b, -1].mean()),
    }
    for b in range(len(settled_B))
  ]


STOPS = ("\n\n", "Question:")  # where an answer ends and the next begins


def score(
  model, task, prompts, golds, *, num_loops, tokens, stats, out_dir, batch_size=8,
  feed=None,
):  # fmt: skip
  """Answer every prompt (`batch_size` at a time; `feed`: see `generate`),
  write answers.jsonl (one line a question) and answers.md (accuracy, and
  each statistic's mean over right and wrong answers); returns the paths
  (process 0 writes; the others return none)."""
  decode = lambda ids: lm.decode(task.tokenizer_json, ids)  # noqa: E731
  said = []
  for at in range(0, len(prompts), batch_size):
    ids = [task_ids(task, p) for p in prompts[at : at + batch_size]]
    g = generate(
      model, ids, tokens, num_loops=num_loops, eos_id=task.eos_id,
      stop=lambda new: any(s in decode(new) for s in STOPS),
      pad_to=(batch_size, 0), feed=feed,
    )  # fmt: skip
    said += g.tokens
  if not sharding.writes():  # every process answered; one writes
    return []
  lines = []
  for i, (new, answer) in enumerate(zip(said, golds, strict=True)):
    text = decode([t for t in new if t != task.eos_id])
    for s in STOPS:
      text = text.split(s)[0]
    pred, want = final_number(text), gold(answer)
    lines.append(
      {"question": i, "correct": pred is not None and pred == want, "predicted": pred}
      | {"gold": want, "generated": text}
      | stats[i]
    )
  out_dir = epath.Path(out_dir)
  storage.write_whole(
    out_dir / "answers.jsonl", "".join(json.dumps(x) + "\n" for x in lines)
  )
  right = [x for x in lines if x["correct"]]
  wrong = [x for x in lines if not x["correct"]]
  table = [
    f"# Answers at R {num_loops}: {len(right)} of {len(lines)} right "
    f"({len(right) / len(lines):.3f})",
    "",
    "| statistic | right | wrong |",
    "|---|---|---|",
  ]
  for k in stats[0]:
    mean = lambda xs: f"{np.mean([x[k] for x in xs]):.4g}" if xs else "-"  # noqa: E731
    table.append(f"| {k} | {mean(right)} | {mean(wrong)} |")
  storage.write_whole(out_dir / "answers.md", "\n".join(table) + "\n")
  print(f"answers: {len(right)} of {len(lines)} right at R {num_loops}")
  return [out_dir / "answers.jsonl", out_dir / "answers.md"]


def task_ids(task, prompt: str) -> list[int]:
  """The prompt's ids as the analyses read it (the tokenizer's own specials)."""
  return lm.encode(task.tokenizer_json, prompt)[: task.seq_len]
