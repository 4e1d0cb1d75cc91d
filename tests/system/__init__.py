"""The product from outside: a real browser, the Compose and ops files, the README's
commands, the examples, the demo and the load run."""
