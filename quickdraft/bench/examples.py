"""Built-in example prompts for `quickdraft generate --example NAME` (README's first command).

Fixed texts, shipped with the package (not drawn from the installed Python's files, as the
benchmark workloads are), so the same command gives the same prompt on every machine. Each
names the workload it stands for, so the speedup it prints can be read for what it is:

- `edit`: an editing request (rename an identifier in a 29-line file, reply with the whole
  file): most of a good answer repeats the prompt, the case suffix decoding and prompt lookup
  are built for. Chat template.
- `chat`: an open question: the answer repeats nothing, and free proposers gain little.
  Chat template.
- `code`: the opening line of a function, raw text: a code model's completion (the bundled pair).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QuickdraftError


@dataclass(frozen=True)
class Example:
    name: str
    workload: str  # one line: what kind of work it stands for
    prompt: str
    chat: bool  # wrap in the model's chat template (an instruction-tuned model)
    max_tokens: int  # new tokens, when --max-tokens is not given


_CART = '''```python
def add_item(cart, name, price, quantity=1):
    cart.append({"name": name, "price": price, "quantity": quantity})
    return cart


def cart_total(cart):
    total = 0
    for item in cart:
        total += item["price"] * item["quantity"]
    return total


def apply_discount(total, percent):
    if percent < 0 or percent > 100:
        raise ValueError("percent must be between 0 and 100")
    return total * (100 - percent) / 100


def receipt(cart, percent=0):
    lines = []
    for item in cart:
        cost = item["price"] * item["quantity"]
        lines.append(f"{item['name']:<12} x{item['quantity']:>3} {cost:>8.2f}")
    total = cart_total(cart)
    lines.append(f"{'total':<12} {total:>13.2f}")
    if percent:
        total = apply_discount(total, percent)
        lines.append(f"{'discounted':<12} {total:>13.2f}")
    return "\\n".join(lines)
```'''

EXAMPLES: dict[str, Example] = {e.name: e for e in (
    Example("edit", "editing: rename an identifier in a 29-line file and return the whole file",
            _CART + "\n\nIn the file above, rename `total` to `subtotal`. Reply with the full file.",
            chat=True, max_tokens=256),
    Example("chat", "open chat: a question whose answer repeats nothing of the prompt",
            "Explain to a ten-year-old why the sky is blue.", chat=True, max_tokens=256),
    Example("code", "code completion: the opening line of a function (raw text, for a code model)",
            "def fibonacci(n):", chat=False, max_tokens=128),
)}


def example(name: str) -> Example:
    try:
        return EXAMPLES[name]
    except KeyError:
        raise QuickdraftError(f"--example must be one of {', '.join(EXAMPLES)}, got {name!r}") from None
