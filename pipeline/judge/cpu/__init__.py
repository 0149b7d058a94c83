"""The CPU judge: a classifier of next states that needs no judge endpoint.

The judge stage (:mod:`pipeline.judge.app`, join, samples, teacher, prompts, parse) reaches it
only through the ``embedding`` backend (:mod:`pipeline.judge.backends.embedding`).

- :mod:`pipeline.judge.cpu.classifier`: MiniLM embeddings, the softmax head and kNN vote, the
  decision (:class:`~pipeline.judge.cpu.classifier.NextStateClassifier`);
- :mod:`pipeline.judge.cpu.finetune`: MiniLM fine-tuned on the labelled user replies, cached;
- :mod:`pipeline.judge.cpu.bank`: the generated bank of user replies it learns from;
- :mod:`pipeline.judge.cpu.toolread`, :mod:`~pipeline.judge.cpu.context`,
  :mod:`~pipeline.judge.cpu.cues`: the rules (tool-result structure as an ordered table of
  named rules, request vs tool call, what a reply's text alone does not show).

Measured figures and how they were produced: ``docs/judge.md``.
"""
