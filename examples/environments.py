"""An environment for agentic GRPO (`--environment examples/environments.py:GuessingGame`): a class
built with no arguments, one fresh instance per completion. `reset(**row)` starts the episode from
the data row's columns and returns text appended to the prompt; its public methods are the tools the
model may call (type hints and docstrings, as any tool); `get_reward()` scores the episode (an extra
reward named after the class, weight 1).

    lora-tune train --objective grpo --base MODEL --data examples/data/guessing.jsonl \
        --environment examples/environments.py:GuessingGame --max-tool-calls 4 ...
"""


class GuessingGame:
    """Guess a secret number between 1 and `high`; each guess is answered higher, lower or correct."""

    def __init__(self):
        self.secret, self.high, self.guesses, self.solved = 0, 0, 0, False

    def reset(self, secret: int, high: int = 20, **row) -> str:
        self.secret, self.high, self.guesses, self.solved = int(secret), int(high), 0, False
        return f" The number is between 1 and {self.high}."

    def guess(self, number: int) -> str:
        """Guesses the secret number.

        Args:
            number: your guess
        """
        self.guesses += 1
        if number == self.secret:
            self.solved = True
            return "correct"
        return "higher" if number < self.secret else "lower"

    def get_reward(self) -> float:
        """1 for a solved game, less for every extra guess; 0 unsolved."""
        return 1.0 / self.guesses if self.solved else 0.0
