"""Chat instructions for distilling a draft from a chat target (plain data, written for quickdraft).

`quickdraft distill` renders each one through the target's chat template and has the target
answer it (greedy and sampled): the draft then learns the target's distributions on the kind
of text it will be asked to draft. HELDOUT is never trained on; the acceptance figures in a
draft's model card are measured on it.
"""

from __future__ import annotations

_CODING = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function that merges two sorted lists into one sorted list.",
    "Write a Python function to count the words in a text file.",
    "Write a Python class for a stack with push, pop and peek methods.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a Python script that reads a CSV file and prints the average of the second column.",
    "Write a function in JavaScript that reverses a string.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Write a bash script that renames every .txt file in a folder to .md.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that checks whether a number is prime.",
    "Implement binary search in Python and explain how it works.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Write a Python generator that yields the prime numbers.",
    "Write a Python function that returns the most common character in a string.",
    "Write a Python dataclass for a book with a title, an author and a year.",
    "Write a Python function that validates an email address with a regular expression.",
    "Show how to read a JSON file in Python and print one of its keys.",
    "Write a Python function that computes the factorial of a number recursively.",
    "Write a C function that swaps two integers using pointers.",
    "Write a Python function that sorts a list of dictionaries by a key.",
    "Write a Python function that returns the intersection of two lists.",
    "Write a simple HTML page with a title and a button.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that computes the greatest common divisor of two numbers.",
    "Write a Python function that checks whether two strings are anagrams.",
    "Write a Python context manager that measures how long a block takes.",
    "Write a Python function that splits a list into chunks of size n.",
    "Write a Rust function that returns the largest number in a vector.",
    "Write unit tests with pytest for a function add(a, b).",
    "Write a Python decorator that logs each call of a function.",
    "Write a Python function that reads a text file and returns its lines in reverse order.",
    "Write a Java method that checks whether a year is a leap year.",
    "Write a Python function that returns the sum of the digits of an integer.",
    "Write a linked list class in Python with an append method.",
    "Write a Python function that converts a Roman numeral to an integer.",
    "Write a Python function that finds the second largest number in a list.",
)

_EDITING = (
    "Fix the bug in this Python code:\n\ndef average(xs):\n    return sum(xs) / len(xs) + 1",
    "Add type hints to this function:\n\ndef scale(values, factor):\n    return [v * factor for v in values]",
    "Rewrite this loop as a list comprehension:\n\nsquares = []\nfor i in range(10):\n    squares.append(i * i)",
    "Add a docstring to this function:\n\ndef area(w, h):\n    return w * h",
    "Make this code more readable:\n\ndef f(a):\n    r=[]\n    for x in a:\n        if x%2==0: r.append(x)\n    return r",
    "Explain what this code does:\n\nprint(sorted(set(words), key=len))",
    "Rename the variables in this code so that their names say what they hold:\n\nx = 3.5\ny = 2\nz = x * y",
    "Convert this Python 2 code to Python 3:\n\nprint \"Hello\"\nfor i in xrange(3):\n    print i",
    "Fix the grammar in this sentence: \"Me and him goes to the store yesterday.\"",
    "Make this sentence more formal: \"Hey, can you send me that report ASAP?\"",
    "Shorten this paragraph: \"The meeting, which was scheduled to take place on Monday, has been moved to Tuesday "
    "because several of the people who were supposed to attend it were not available on Monday.\"",
    "Rewrite this sentence in the passive voice: \"The committee approved the new budget.\"",
    "Correct the spelling mistakes: \"I recieved the pakage yesturday and it was definately broken.\"",
    "Turn these notes into a polite email: meeting moved to 3pm, bring the slides, room 204.",
    "Paraphrase this sentence: \"The quick brown fox jumps over the lazy dog.\"",
    "Make this text friendlier: \"Your request has been denied. Do not contact us again about this.\"",
    "Summarize this text in one sentence: \"Photosynthesis is the process by which green plants use sunlight, "
    "water and carbon dioxide to make glucose and oxygen. It takes place mainly in the leaves.\"",
    "Translate this sentence into French: \"The weather is nice today.\"",
    "Translate this sentence into Spanish: \"Where is the train station?\"",
    "Add error handling to this code:\n\ndef read(path):\n    return open(path).read()",
    "Refactor this code to avoid repetition:\n\nprint('Hello Alice')\nprint('Hello Bob')\nprint('Hello Carol')",
    "Find the error in this SQL query: SELECT name FROM users WHERE age > 30 ORDER name;",
    "Rewrite this function to use a dictionary instead of if statements:\n\ndef color(code):\n"
    "    if code == 1:\n        return 'red'\n    if code == 2:\n        return 'green'\n    return 'blue'",
    "Simplify this expression in Python: not (a and b) or (not a)",
)

_EXPLAIN = (
    "Explain what a hash table is.",
    "Explain the difference between a list and a tuple in Python.",
    "What is recursion? Give an example.",
    "Explain how photosynthesis works.",
    "Why is the sky blue?",
    "Explain what an API is to a beginner.",
    "What causes the seasons on Earth?",
    "Explain the difference between RAM and storage.",
    "What is machine learning?",
    "Explain how a car engine works in simple terms.",
    "What is the difference between weather and climate?",
    "Explain what inflation is.",
    "How does the internet work?",
    "What is gravity?",
    "Explain the water cycle.",
    "What is the difference between a virus and a bacterium?",
    "Explain what Git is and why developers use it.",
    "What is a black hole?",
    "Explain Big O notation.",
    "Why do we need sleep?",
    "How do vaccines work?",
    "What is the difference between a compiler and an interpreter?",
    "Explain what a neural network is.",
    "What does a CPU do?",
    "Explain the difference between HTTP and HTTPS.",
    "What is democracy?",
    "Explain how a rainbow forms.",
    "Why do leaves change color in autumn?",
    "What is an operating system?",
    "Explain what a function is in programming.",
    "How do plants grow from seeds?",
    "What is the difference between speed and velocity?",
    "Explain what DNA is.",
    "What is a prime number?",
    "Explain object-oriented programming.",
    "How does a refrigerator keep food cold?",
    "What are the causes of climate change?",
    "Explain the difference between a process and a thread.",
    "What is the purpose of a database index?",
    "How do airplanes stay in the air?",
)

_LISTS = (
    "List five tips for staying productive while working from home.",
    "Give me a list of ten healthy snacks.",
    "List the planets of the solar system in order from the Sun.",
    "What are five good habits for writing clean code?",
    "List some ways to reduce stress.",
    "Give me seven ideas for a birthday party.",
    "List the main features of Python.",
    "What are the benefits of regular exercise?",
    "List five common data structures and what they are used for.",
    "Give me a packing list for a weekend camping trip.",
    "List ten countries in Europe and their capitals.",
    "What are some good books for learning programming?",
    "List the steps to make a cup of tea.",
    "Give five tips for a job interview.",
    "List the pros and cons of electric cars.",
    "What are some ways to save money each month?",
    "List six ideas for a science fair project.",
    "Give me a weekly meal plan for a vegetarian.",
    "List the steps to set up a Python virtual environment.",
    "What are the main differences between cats and dogs as pets?",
    "List five ways to improve sleep quality.",
    "Give me a list of questions to ask at the end of an interview.",
    "List the primary colors and the secondary colors.",
    "What should I check before buying a used car?",
    "List some fun things to do on a rainy day.",
    "Give me five names for a coffee shop.",
    "List the steps to change a flat tire.",
    "List common mistakes beginners make when learning to code.",
)

_MATH = (
    "A shop sells apples at 3 dollars a kilogram. How much do 4.5 kilograms cost?",
    "Tom has 24 marbles and gives a third of them to his sister. How many does he have left?",
    "A train travels 180 kilometers in 2 hours. What is its average speed?",
    "If a rectangle is 8 meters long and 5 meters wide, what are its area and perimeter?",
    "A pizza is cut into 8 slices. If 3 people eat 2 slices each, how many slices are left?",
    "Sarah saves 15 dollars every week. How many weeks does she need to save 240 dollars?",
    "A shirt costs 40 dollars and is on sale for 25 percent off. What is the sale price?",
    "What is 15 percent of 80?",
    "Solve for x: 3x + 7 = 22.",
    "A car uses 6 liters of fuel per 100 kilometers. How much fuel does it need for 350 kilometers?",
    "There are 30 students in a class and 40 percent of them are boys. How many girls are there?",
    "A recipe needs 2 cups of flour for 12 cookies. How much flour is needed for 30 cookies?",
    "What is the sum of the first 10 positive integers?",
    "A tank holds 500 liters and is filled at 25 liters per minute. How long does it take to fill?",
    "John is twice as old as his son. In 10 years the sum of their ages will be 65. How old are they now?",
    "A bag has 5 red balls and 3 blue balls. What is the probability of drawing a blue ball?",
    "Convert 2.5 hours into minutes.",
    "What is the area of a circle with a radius of 7 centimeters?",
    "A book has 320 pages. If Maria reads 40 pages a day, how many days will it take her to finish it?",
    "Three friends share a bill of 87 dollars equally. How much does each pay?",
    "A worker earns 18 dollars an hour and works 37 hours a week. What are the weekly earnings?",
    "What is the average of 12, 15, 20 and 33?",
    "A garden is 12 meters by 9 meters. How much fencing is needed to go around it?",
    "If 5 pencils cost 2 dollars, how much do 18 pencils cost?",
    "A cyclist rides at 15 kilometers per hour for 3 hours and 20 minutes. How far does she go?",
    "Simplify the fraction 36/48.",
    "What is 7 times 8 plus 12 divided by 4?",
    "A store had 120 books and sold 45 on Monday and 30 on Tuesday. How many books are left?",
    "The price of a phone rose from 200 to 250 dollars. By what percentage did it increase?",
    "How many seconds are there in a day?",
)

_WRITING = (
    "Write a short poem about the ocean.",
    "Write a haiku about autumn.",
    "Write a short story about a robot who learns to paint.",
    "Write a product description for a reusable water bottle.",
    "Write a thank-you note to a teacher.",
    "Write a tweet announcing the launch of a new app.",
    "Write a cover letter for a junior software developer position.",
    "Write a short speech for a friend's wedding.",
    "Write a limerick about a cat.",
    "Write the opening paragraph of a mystery novel.",
    "Write a short motivational message for someone starting a new job.",
    "Write a dialogue between a customer and a waiter.",
    "Write a short blog post about the benefits of reading.",
    "Write an email asking a colleague for feedback on a report.",
    "Write a short poem about the city at night.",
    "Write a description of a sunset over the mountains.",
    "Write a bedtime story for a young child about a brave little mouse.",
    "Write a review of a fictional restaurant.",
    "Write an apology email for missing a meeting.",
    "Write a short advertisement for a bakery.",
    "Write a slogan for a recycling campaign.",
    "Write a letter to your future self.",
    "Write a short poem about friendship.",
    "Write a job posting for a graphic designer.",
    "Write a summary of the story of Cinderella.",
    "Write a short introduction for a presentation about renewable energy.",
    "Write an invitation to a team lunch on Friday.",
    "Write a short fable with a moral about patience.",
)

_QA = (
    "What is the capital of Australia?",
    "Who wrote Romeo and Juliet?",
    "How many continents are there?",
    "What is the boiling point of water in Fahrenheit?",
    "What is the largest mammal on Earth?",
    "Who painted the Mona Lisa?",
    "What is the chemical symbol for gold?",
    "How far is the Moon from the Earth?",
    "What language is spoken in Brazil?",
    "What is the tallest mountain in the world?",
    "How many bones are in the human body?",
    "What year did the Second World War end?",
    "What is the speed of light?",
    "Hi! How are you today?",
    "Can you recommend a good movie for a family night?",
    "What should I cook for dinner tonight?",
    "How can I learn to play the guitar?",
    "What is the best way to learn a new language?",
    "How do I make a good first impression?",
    "What is the meaning of the word 'ephemeral'?",
)

INSTRUCTIONS: tuple[str, ...] = _CODING + _EDITING + _EXPLAIN + _LISTS + _MATH + _WRITING + _QA

# Never trained on: the acceptance measured for a draft's card.
HELDOUT: tuple[str, ...] = (
    "Write a Python function that returns the list of all divisors of a number.",
    "Write a Python function that capitalizes the first letter of every word in a sentence.",
    "Write a SQL query that counts the orders placed in each month.",
    "Fix the bug in this code:\n\ndef last(xs):\n    return xs[len(xs)]",
    "Rewrite this sentence to be more concise: \"In my personal opinion, I think that we should probably "
    "start the project as soon as possible.\"",
    "Explain what a linked list is and when to use one.",
    "Explain how the heart pumps blood through the body.",
    "What is the difference between a stock and a bond?",
    "Explain what a REST API is.",
    "List eight tips for learning to cook.",
    "Give me a list of five outdoor activities for the summer.",
    "List the steps to plant a tree.",
    "A farmer has 48 cows and buys 12 more, then sells a quarter of the herd. How many cows are left?",
    "A movie starts at 7:45 pm and lasts 2 hours and 25 minutes. When does it end?",
    "What is 12 percent of 250?",
    "Write a short poem about the rain.",
    "Write a short story about a lost dog finding its way home.",
    "Write an email inviting colleagues to a farewell party.",
    "What is the smallest country in the world?",
    "How can I become a better public speaker?",
)


# --- composed instructions: many more distinct requests than the list above -------------------
# A head (or a draft) trained on the target's answers to a few hundred requests learns those
# answers; thousands of distinct requests teach it the target's style in general. These are
# request templates crossed with topics (and arithmetic problems with drawn numbers). The
# subjects of HELDOUT and of the chat benchmark's prompts are left out, so the acceptance
# measured on them stays a measurement on unseen requests.

_TOPICS = (
    "photosynthesis", "volcanoes", "the Roman Empire", "the printing press", "electric cars", "solar panels",
    "coral reefs", "the human immune system", "black holes", "compound interest",
    "machine learning", "public transport", "recycling", "honeybees", "the moon landing", "earthquakes",
    "the Great Wall of China", "chess", "jazz music", "the Olympic Games", "renewable energy", "coffee",
    "chocolate", "the internet", "smartphones", "social media", "the Renaissance", "ancient Egypt",
    "the water cycle", "glaciers", "deserts", "rainforests", "penguins", "elephants", "dolphins", "octopuses",
    "wolves", "the human brain", "memory", "habits", "meditation", "running", "yoga", "swimming",
    "baking bread", "making pasta", "tea", "vitamins", "antibiotics", "vaccines",
    "the printing of money", "taxes", "budgeting", "saving for retirement", "renting an apartment",
    "buying a house", "job interviews", "time management", "leadership", "teamwork",
    "negotiation", "learning a language", "reading", "writing a novel", "photography", "painting",
    "classical music", "the guitar", "the piano", "film making", "video games", "board games",
    "football", "basketball", "tennis", "cycling", "hiking", "camping", "travelling by train", "airports",
    "hotels", "museums", "libraries", "schools", "universities", "online courses", "homework",
    "databases", "spreadsheets", "cloud computing", "cybersecurity", "passwords", "encryption",
    "operating systems", "open source software", "version control", "unit testing", "debugging",
    "sorting algorithms", "recursion", "hash functions", "graphs", "binary trees", "regular expressions",
    "JSON", "HTML", "CSS", "JavaScript", "Python", "Rust", "SQL", "the command line", "Docker",
    "robots", "3D printing", "satellites", "Mars", "the Sun", "comets", "tides", "magnets",
    "electricity", "batteries", "light", "sound", "rainbows", "clouds", "thunderstorms", "snow",
    "wind turbines", "nuclear power", "bridges", "skyscrapers", "the wheel", "the telephone",
    "the steam engine", "clocks", "maps", "the alphabet", "numbers", "fractions", "probability",
    "statistics", "geometry", "the Pythagorean theorem", "prime numbers", "infinity", "logic puzzles",
    "friendship", "kindness", "gratitude", "patience", "motivation", "procrastination", "happiness",
    "moving to a new city", "starting a small business", "customer service", "marketing", "advertising",
    "newspapers", "podcasts", "birds", "mushrooms", "spiders", "butterflies", "sharks",
    "the ocean", "rivers", "mountains", "islands", "the Arctic", "the Amazon river", "pizza", "sushi",
    "breakfast", "spices", "kitchen safety", "first aid", "fire safety",
    "dentists", "hospitals", "nurses", "farming", "bees and pollination", "wine", "cheese", "bicycles",
)

_TEMPLATES = (
    "Explain {t} to a beginner.",
    "Explain {t} in simple terms.",
    "What are three interesting facts about {t}?",
    "Give me five facts about {t}.",
    "Write a short paragraph about {t}.",
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "Write a short story that involves {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Summarize the history of {t} in a few sentences.",
    "Why is {t} important?",
    "How would you explain {t} to a child?",
    "List some common misconceptions about {t}.",
    "Write a tweet about {t}.",
    "Give me a quiz of three questions about {t}, with the answers.",
    "Write an introduction for a blog post about {t}.",
    "What should a beginner know about {t}?",
    "Write a short email to a friend recommending that they learn about {t}.",
    "Describe {t} in three sentences.",
    "What questions would you ask an expert on {t}?",
    "Write a product description for a book about {t}.",
    "Give me a study plan for learning about {t} in one week.",
    "Compare {t} and {u}.",
    "What do {t} and {u} have in common?",
    "Write a dialogue between two friends talking about {t}.",
    "Give me a list of words related to {t}.",
    "Write a motivational message that mentions {t}.",
    "Tell me a joke about {t}.",
)

_ARITHMETIC = (
    "A shop sells {item} at {a} dollars each. How much do {b} of them cost?",
    "{name} has {a} {item} and gives away {b}. How many are left?",
    "A car travels {a} kilometers in {b} hours. What is its average speed?",
    "What is {a} times {b}?",
    "A box holds {b} {item}. How many boxes are needed for {c} {item}?",
    "{name} reads {a} pages a day. How many days does a {c}-page book take?",
    "The price of a jacket is {c} dollars and it is reduced by {a} percent. What is the new price?",
)
_NAMES = ("Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kate", "Liam")
_ITEMS = ("apples", "pencils", "books", "cookies", "marbles", "stickers", "eggs", "bottles", "cards", "tickets")


def composed_instructions(n: int, seed: int = 0) -> list[str]:
    """`n` distinct requests (templates x topics, and arithmetic with drawn numbers), in a
    reproducible shuffled order; none is in INSTRUCTIONS or HELDOUT."""
    import random

    rng = random.Random(seed)
    taken = set(INSTRUCTIONS) | set(HELDOUT)
    out: list[str] = []
    seen: set[str] = set()
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(f"could not compose {n} distinct instructions")
        if rng.random() < 0.12:
            text = rng.choice(_ARITHMETIC).format(a=rng.randint(2, 60), b=rng.randint(2, 12), c=rng.randint(61, 900),
                                                  item=rng.choice(_ITEMS), name=rng.choice(_NAMES))
        else:
            t, u = rng.sample(_TOPICS, 2)
            text = rng.choice(_TEMPLATES).format(t=t, u=u)
            text = text[0].upper() + text[1:]
        if text not in seen and text not in taken:
            seen.add(text)
            out.append(text)
    return out


def chat_instructions(n: int, seed: int = 0) -> list[str]:
    """`n` training requests: INSTRUCTIONS first, then composed ones."""
    base = list(INSTRUCTIONS[:n])
    return base + composed_instructions(n - len(base), seed)
