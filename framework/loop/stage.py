"""The phase a step runs in."""

from enum import Enum


class Stage(str, Enum):
    """Which step method a batch goes through.

    Example:
        >>> Stage.TRAIN.value
        'train'
    """

    TRAIN = "train"
    VAL = "val"
    TEST = "test"
    PREDICT = "predict"
