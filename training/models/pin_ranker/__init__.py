"""The ``pin_ranker`` model family: a TransAct-style multi-task ranker (action sequence + sparse ids + dense counts).

A file per job: ``model.py`` the network (:class:`~training.models.pin_ranker.model.PinRanker`, its sizes and its
serving form), ``ids.py`` how raw ids become table rows (hashed or managed), ``params.py`` the hyperparameters,
``inputs.py`` rows of ``examples`` → tensors, ``evaluate.py`` the metrics on the evaluation day, ``score.py`` the
corpus in a non-personalised context, and ``family.py`` the SDK side (training/sdk.py) that puts them together.
The family is found by this package's name (``training.models.pin_ranker``, core/registry.py).
"""

from training.models.pin_ranker.family import PinRankerFamily

__all__ = ["PinRankerFamily"]
