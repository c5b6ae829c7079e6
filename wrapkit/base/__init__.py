"""What every layer stands on, besides agreement and gathering: torch's module internals behind functions, torch's
own ops where DeepSpeed replaced them, memory sizes and budgets, and argument checks."""
