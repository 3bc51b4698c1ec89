"""Text and text-pair classification (`task.name=textcls`): the second built-in task, and the
worked example of where a fork's code lives (settings, data reading, the Task subclass)."""
