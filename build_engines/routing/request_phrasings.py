"""How users phrase requests: two disjoint banks of templates, one for training items and one for the benchmark.

A template is filled from one fact (`request_facts`) plus, for chat, everyday slot words; it applies only when every
field it names is present and non-empty in the fact. The `train` bank builds the router's request-style training
items; the `benchmark` bank builds the natural-request benchmark only. The two banks share no template, no opener
or closer and no chat slot word (checked by `test_request_routing.py`), so a benchmark request is never a training
phrasing filled with other words: what carries over is the domain, not the sentence.

Both banks mix questions and imperatives, short and long requests, requests that name the tool, module or property
and requests that only describe the goal, and requests with a pasted snippet (usage line, code, CSS rule).
"""

from __future__ import annotations

BANKS = ("train", "benchmark")

TEMPLATES: dict[str, dict[str, list[str]]] = {
    "train": {
        "agent": [
            "what does the {option} option of {cmd} do?",
            "how do I {summary} on the command line?",
            "explain the {option} flag in `{cmd}`",
            "I want to {summary}. which command should I use and how?",
            "show me an example of {cmd} {option}",
            "what is {cmd} used for?",
            "give me the {cmd} command that will {option_desc}",
            "in {cmd}, how can I {option_desc}?",
            "what's the difference between {option} and {option2} in {cmd}?",
            "can you explain this command: {usage}",
            "run {cmd} with {option} for me",
            "{cmd} {option} - what does it mean?",
            "why would I pass {option} to {cmd}?",
            "write a shell one-liner that uses {cmd} to {option_desc}",
            "how do I use {cmd}?",
            "I typed `{cmd} {option}` in my terminal, what happened?",
            "which option of {cmd} should I use to {option_desc}?",
            "what are the options of {cmd}? I mostly need to {option_desc}",
            "tell me how to {summary} in linux",
            "the man page of {cmd} says {option} will {option_desc}. can you explain with an example?",
        ],
        "code": [
            "write a python function that will {purpose}",
            "what does {module}.{name}() do?",
            "how do I use {name} from the {module} module?",
            "explain this python code:\n{snippet}",
            "implement {name}({args}) in python",
            "why does my call to {module}.{name} fail?",
            "show me how to import {name} from {module}",
            "what arguments does {name} take in {module}?",
            "can you refactor this function?\n{snippet}",
            "I need python code to {purpose}. can you write it?",
            "how does the {name} {kind} in {module} work?",
            "write a python {kind} called {name} that will {purpose}",
            "add type hints and a docstring to this:\n{snippet}",
            "is there a standard library {kind} to {purpose}?",
            "what's a pythonic way to {purpose}?",
            "debug this python:\n{snippet}",
            "in python, when should I call {name}({args})?",
            "write unit tests for {module}.{name}",
        ],
        "design": [
            "how do I set {property} in css?",
            "what does `{property}: {value}` do?",
            "make the {selector} element use {property} {value}",
            "how can I change {phrase} of {selector}?",
            "fix my stylesheet:\n{snippet}",
            "what values can {property} take in css?",
            "write css for {selector} that sets {phrase}",
            "why is my {property} not working on {selector}?",
            "how do I control {phrase} on my web page?",
            "explain this css rule:\n{snippet}",
            "which css property sets {phrase}?",
            "give {selector} a {property} of {value}",
            "my page layout is broken, how do I fix {phrase}?",
            "style {selector} with {property}: {value} and explain it",
            "how do I center a {element} horizontally and vertically?",
            "convert this css to scss with a variable:\n{snippet}",
            "what's the best way to handle {phrase} in a responsive design?",
        ],
        "chat": [
            "{utterance}",
            "hey, how was your {time}?",
            "I feel {feeling} today",
            "what do you think about {topic}?",
            "tell me about your favourite {thing}",
            "I just got back from {place}, it was {adjective}",
            "do you like {things}?",
            "my {person} is annoying me, what should I do?",
            "good morning! any plans for {time}?",
            "someone just told me \"{utterance}\" - what would you say back?",
            "lol, {utterance}",
            "I'm so {feeling}, I can't stop thinking about {topic}",
            "can we just talk for a bit? I'm {feeling}",
            "what's your opinion on {topic}? my {person} and I keep arguing about it",
            "would you rather go to {place} or stay home this {time}?",
            "thanks, that made my day!",
        ],
    },
    "benchmark": {
        "agent": [
            "Could you walk me through the {option} switch of the {cmd} tool?",
            "Is there a terminal command to {summary}?",
            "Please tell me what happens when I type {cmd} {option}.",
            "My goal: {option_desc}. What do I type with {cmd}?",
            "Break down this usage line for me: {usage}",
            "Explain to me the purpose of the {cmd} program.",
            "Which flag makes {cmd} {option_desc}?",
            "Help me understand when to reach for {cmd}.",
            "On my server I need to {summary}; what's the shell way?",
            "Does {cmd} have a switch to {option_desc}?",
            "Give me a bash example with {cmd} and {option}, please.",
            "Compare {option} with {option2} for {cmd}.",
        ],
        "code": [
            "Could you code up a Python routine which will {purpose}?",
            "Tell me about the {name} {kind} in Python's {module} library.",
            "Please review the following snippet and tell me what it returns:\n{snippet}",
            "What's the signature of {module}.{name}?",
            "Give me a usage example for {module}.{name}.",
            "Using Python 3, {purpose} - how?",
            "Rewrite this more cleanly:\n{snippet}",
            "When I call {name}({args}) from {module}, what do I get back?",
            "Create a {kind} named {name} whose job is to {purpose}.",
            "Any idea why this Python raises an exception?\n{snippet}",
            "Which module should I import to {purpose} in Python?",
            "Document this function for me:\n{snippet}",
        ],
        "design": [
            "Could you help me adjust {phrase} on my site?",
            "In my stylesheet, what effect does `{property}: {value}` have?",
            "Please give the {selector} selector {property} set to {value}.",
            "What's wrong with this CSS?\n{snippet}",
            "Which CSS rule lets me tune {phrase}?",
            "How would I centre a {element} on the page using CSS?",
            "I'm building a landing page - how do I tweak {phrase} for {selector}?",
            "Tidy up these styles:\n{snippet}",
            "Is {value} a sensible value for {property}?",
            "Show me a stylesheet where {selector} changes {phrase}.",
            "My {element} looks off on mobile; how do I fix {phrase} with CSS?",
            "What does the browser do with {property} on {selector}?",
        ],
        "chat": [
            "Hi there! {utterance}",
            "Ugh, what a {time}. How are you holding up?",
            "Honestly I've been feeling {feeling} lately.",
            "So what's your take on {topic}?",
            "Guess what, I'm heading to {place} soon!",
            "Do you ever get {feeling} for no reason?",
            "My {person} said \"{utterance}\" and I have no idea how to respond.",
            "Can you cheer me up? It's been a {adjective} {time}.",
            "Be honest: are {things} overrated?",
            "{utterance} Anyway, how's your day going?",
            "Wanna hear something funny about my {person}?",
            "I miss {place} so much.",
        ],
    },
}

OPENERS: dict[str, list[str]] = {
    "train": ["", "", "", "", "hi, ", "quick question: ", "please, ", "hey! ", "I'm stuck. ",
              "sorry if this is basic, "],
    "benchmark": ["", "", "", "", "Hello. ", "Excuse me, ", "Hey there, ", "One more thing: ", "Need help. "],
}
CLOSERS: dict[str, list[str]] = {
    "train": ["", "", "", "", " thanks!", " thank you", " I'm new to this.", " asap please"],
    "benchmark": ["", "", "", "", " Cheers.", " Much appreciated!", " (for a project at work)", " Thanks in advance."],
}

# Everyday words for chat templates (and a few layout elements for design ones); disjoint between the banks.
SLOTS: dict[str, dict[str, list[str]]] = {
    "train": {
        "time": ["weekend", "day", "holiday", "evening", "birthday", "summer"],
        "feeling": ["tired", "happy", "lonely", "nervous", "excited", "bored", "sad", "grateful"],
        "topic": ["pineapple on pizza", "reality shows", "my new haircut", "long-distance relationships",
                  "the weather lately", "getting up early", "that new movie", "online dating"],
        "thing": ["movie", "song", "food", "book", "holiday spot", "season"],
        "things": ["cats", "rainy days", "horror films", "road trips", "board games", "surprises"],
        "place": ["my grandma's house", "the beach", "a wedding", "the gym", "a concert", "the mall"],
        "adjective": ["amazing", "awful", "weird", "so much fun", "exhausting"],
        "person": ["roommate", "sister", "boss", "boyfriend", "neighbour", "best friend"],
        "element": ["div", "button", "image", "header", "card", "form"],
    },
    "benchmark": {
        "time": ["week", "morning", "night", "Monday", "vacation", "winter"],
        "feeling": ["exhausted", "thrilled", "anxious", "homesick", "cheerful", "restless", "down", "hopeful"],
        "topic": ["tipping culture", "celebrity gossip", "working from home", "breakfast for dinner",
                  "the last football match", "social media detox", "dogs versus cats", "first dates"],
        "thing": ["film", "album", "meal", "novel", "city", "hobby"],
        "things": ["musicals", "sunny afternoons", "camping trips", "family dinners", "pop songs", "karaoke nights"],
        "place": ["Paris", "my hometown", "the countryside", "my cousin's party", "the lake", "a music festival"],
        "adjective": ["rough", "lovely", "strange", "hectic", "boring"],
        "person": ["mom", "brother", "coworker", "girlfriend", "landlord", "old classmate"],
        "element": ["login box", "modal dialog", "logo", "navigation bar", "hero banner", "footer"],
    },
}

# The zero-shot fifth domain (Shakespeare's plays, `request_facts.play_facts`): requests for evaluating a head that
# never saw the domain, phrased in the benchmark's style (and filled with the benchmark bank's openers/closers).
ZERO_SHOT_TEMPLATES: dict[str, list[str]] = {
    "drama": [
        "Who is {character} in {play}?",
        "Recite a speech by {character} from {play}.",
        "What does this line from {play} mean: \"{line}\"",
        "Summarise the plot of {play} for me.",
        "Write a few lines of blank verse for {character}.",
        "Which of Shakespeare's plays has a character called {character}?",
        "Explain the scene where {character} says \"{line}\"",
        "Put this into modern English: \"{line}\"",
        "In {play}, what part does {character} play in the story?",
        "Give me a famous quotation from {play}.",
        "Is {play} a comedy or a tragedy?",
        "Continue this verse in Shakespeare's style: \"{line}\"",
    ],
}
