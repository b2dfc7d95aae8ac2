"""Generate ``semantic_pairs.jsonl``: the evaluation set of ``bench_semantic.py``.

Written for kvmem (issue 4, requirement 5). Each line is one JSON object
``{"query", "stored", "label", "kind"}``: ``stored`` is what a cache holds,
``query`` what a user asks, ``label`` whether the stored answer may be returned:

- ``paraphrase``: the same question in other words (must hit). Hand-written,
  varied wording (reordering, synonyms, register, typos), not template swaps.
- ``near_miss``: looks alike but asks something else (must not hit). ``kind``
  says how: ``entity`` (other country/city/product), ``person``, ``number``,
  ``unit``, ``negation``, ``antonym``, ``order`` (swapped arguments).
- ``unrelated``: a different topic (must not hit).

Deterministic: the slot lists are fixed and the only randomness is a seeded
``random.Random``. Regenerate with ``python benchmarks/data/make_semantic_pairs.py``.
"""

from __future__ import annotations

import random
from pathlib import Path

from pairs_io import write_pairs

SEED = 4
OUT = Path(__file__).with_name("semantic_pairs.jsonl")

# -- hand-written paraphrases: (stored, query) ----------------------------------------------
PARAPHRASES = [
    ("How do I reset my password?", "I forgot my password, how can I reset it?"),
    ("What is the capital of France?", "Which city is France's capital?"),
    ("How do I cancel my subscription?", "What's the way to end my subscription?"),
    ("What are your opening hours?", "When are you open?"),
    ("How can I track my order?", "Where can I see the status of my order?"),
    ("Can I get a refund for my purchase?", "Is it possible to get my money back for what I bought?"),
    ("How do I change my email address?", "How can I update the email on my account?"),
    ("What is the boiling point of water?", "At what temperature does water boil?"),
    ("Who wrote Pride and Prejudice?", "Who is the author of Pride and Prejudice?"),
    ("How do I install Python on Windows?", "What are the steps to set up Python on a Windows machine?"),
    ("What is machine learning?", "Can you explain what machine learning is?"),
    ("How do I delete my account?", "I want to remove my account, how do I do that?"),
    ("What time does the store close?", "When does the shop close?"),
    ("How long does shipping take?", "How many days until my package arrives?"),
    ("Do you ship internationally?", "Can you deliver to other countries?"),
    ("How do I sort a list in Python?", "What's the way to sort a Python list?"),
    ("What is the speed of light?", "How fast does light travel?"),
    ("How do I make a cup of tea?", "What's the best way to brew tea?"),
    ("Why is the sky blue?", "What makes the sky look blue?"),
    ("How do I reverse a string in JavaScript?", "In JavaScript, how can I reverse a string?"),
    ("What does HTTP stand for?", "What is the full form of HTTP?"),
    ("How many people live in Tokyo?", "What is the population of Tokyo?"),
    ("How do I contact customer support?", "How can I reach your support team?"),
    ("Is there a student discount?", "Do you offer discounts for students?"),
    ("What payment methods do you accept?", "Which ways can I pay?"),
    ("How do I merge two dictionaries in Python?", "How can I combine two dicts in Python?"),
    ("What is the tallest mountain in the world?", "Which mountain is the highest on Earth?"),
    ("How do I update my shipping address?", "How can I change the delivery address?"),
    ("What causes earthquakes?", "Why do earthquakes happen?"),
    ("How do I print to the console in Java?", "In Java, how do you write output to the console?"),
    ("Can I change my flight date?", "Is it possible to reschedule my flight to another day?"),
    ("How do I get a copy of my invoice?", "Where can I download my invoice?"),
    ("What is photosynthesis?", "Explain the process of photosynthesis."),
    ("How do I turn on dark mode?", "How can I switch the app to dark mode?"),
    ("How much does the premium plan cost?", "What is the price of the premium plan?"),
    ("What is the difference between a list and a tuple in Python?", "How does a Python list differ from a tuple?"),
    ("How do I undo the last git commit?", "How can I revert my most recent git commit?"),
    ("Who painted the Mona Lisa?", "Which artist painted the Mona Lisa?"),
    ("How do I lose weight quickly?", "What's the fastest way to lose weight?"),
    ("What is the meaning of life?", "What's the purpose of life?"),
    ("How can I improve my sleep?", "What can I do to sleep better?"),
    ("Where is the nearest train station?", "Where's the closest railway station?"),
    ("How do I add a user in Linux?", "How to create a new user account on Linux?"),
    ("What is an API?", "Can you tell me what an API is?"),
    ("How do I connect to Wi-Fi?", "How can I join a wireless network?"),
    ("What's the weather like today?", "How is the weather today?"),
    ("How do I pay my bill online?", "Can I pay my bill on the website?"),
    ("How do I return an item?", "What's the process for sending a product back?"),
    ("What is the warranty period?", "How long is the warranty?"),
    ("How can I speak to a human agent?", "I want to talk to a real person, not a bot."),
    ("How do I enable two-factor authentication?", "How can I turn on 2FA for my account?"),
    ("What is the Pythagorean theorem?", "Explain Pythagoras' theorem."),
    ("How do I check my account balance?", "Where can I see how much money is in my account?"),
    ("How do I create a virtual environment in Python?", "How do I make a Python venv?"),
    ("What are the symptoms of the flu?", "What signs indicate that someone has influenza?"),
    ("How do I bake bread at home?", "What's a good way to make homemade bread?"),
    ("What is the largest ocean?", "Which ocean is the biggest?"),
    ("How do I read a file line by line in Python?", "In Python, how can I iterate over the lines of a file?"),
    ("When was the Eiffel Tower built?", "In what year was the Eiffel Tower constructed?"),
    ("How do I upgrade my plan?", "How can I move to a higher subscription tier?"),
    ("How do I find my order number?", "Where do I locate my order ID?"),
    ("Does the hotel have free parking?", "Is parking free at the hotel?"),
    ("Is breakfast included in the room rate?", "Does the room price include breakfast?"),
    ("How do I convert a string to an integer in Python?", "How can I turn a string into an int in Python?"),
    ("What is the difference between weather and climate?", "How do weather and climate differ?"),
    ("How do I clear my browser cache?", "How can I empty the cache in my web browser?"),
    ("Can I bring my dog on the train?", "Are dogs allowed on trains?"),
    ("How do I apply for a passport?", "What's the procedure to get a passport?"),
    ("What is inflation?", "Can you explain inflation in economics?"),
    ("How do I take a screenshot on a Mac?", "What's the shortcut to capture the screen on macOS?"),
    ("How do I stop my nose from bleeding?", "What should I do to stop a nosebleed?"),
    ("What is the best way to learn a new language?", "How should I go about learning a foreign language?"),
    ("How do I unsubscribe from your newsletter?", "How can I stop receiving your newsletter emails?"),
    ("Who discovered penicillin?", "Who was the discoverer of penicillin?"),
    ("How do I set up a new printer?", "What are the steps to install a new printer?"),
    ("How do I know if my order has shipped?", "How can I tell whether my order was dispatched?"),
    ("What is the return policy?", "What are your rules for returns?"),
    ("How do I center a div in CSS?", "What's the way to horizontally and vertically center a div with CSS?"),
    ("How do I make my code run faster?", "How can I speed up my program?"),
    ("What is a black hole?", "Can you describe what a black hole is?"),
    ("How do I write a cover letter?", "Any tips for writing a cover letter?"),
    ("Where can I find my API key?", "Where is my API key located?"),
    ("How do I rename a file in Linux?", "What command renames a file on Linux?"),
    ("hw do i reset my pasword", "How do I reset my password?"),
    ("Whats the capital of Italy", "What is the capital city of Italy?"),
    ("How do I use a for loop in Python?", "How do for loops work in Python?"),
    ("What is the recommended daily water intake?", "How much water should I drink every day?"),
    ("How do I get to the airport from downtown?", "What's the best way to reach the airport from the city center?"),
    ("Can I use my phone abroad?", "Will my phone work when I travel to another country?"),
    ("How do I share a document with my team?", "How can I give my colleagues access to a document?"),
    ("What is quantum computing?", "Explain quantum computing to me."),
    ("How do I back up my iPhone?", "What's the way to make a backup of my iPhone?"),
    ("How do I remove a stain from a shirt?", "How can I get a stain out of my shirt?"),
    ("What are the side effects of ibuprofen?", "What adverse effects can ibuprofen cause?"),
    ("How do I create a pivot table in Excel?", "How can I make a pivot table with Excel?"),
    ("What is the GDP of a country?", "What does a country's GDP measure?"),
    ("How do I cook rice?", "What's the method for cooking rice?"),
    ("How can I reduce stress?", "What are ways to lower my stress levels?"),
    ("Why is my laptop so slow?", "What could be making my laptop run slowly?"),
    ("How do I plant tomatoes?", "What's the right way to grow tomato plants?"),
    ("Is the museum wheelchair accessible?", "Can wheelchair users get into the museum?"),
    ("How do I join the loyalty program?", "How can I sign up for your rewards program?"),
    ("What is the password policy?", "What are the requirements for passwords?"),
    ("Explain recursion in simple terms.", "Can you give a simple explanation of recursion?"),
    ("How do I tie a tie?", "What are the steps for tying a necktie?"),
    ("What's the difference between RAM and storage?", "How is RAM different from disk storage?"),
    ("How do I get rid of hiccups?", "What's a way to stop hiccups?"),
    ("How do I report a bug?", "Where should I file a bug report?"),
    ("Summarize the plot of Hamlet.", "Give me a summary of Hamlet's story."),
    ("How do I schedule a meeting in Outlook?", "How can I set up a meeting using Outlook?"),
]

# -- near misses: (stored, query, kind) built from templates and slot lists ------------------
CAPITALS = [
    ("France", "Paris"),
    ("Germany", "Berlin"),
    ("Italy", "Rome"),
    ("Spain", "Madrid"),
    ("Japan", "Tokyo"),
    ("Canada", "Ottawa"),
    ("Brazil", "Brasilia"),
    ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"),
    ("Australia", "Canberra"),
    ("Norway", "Oslo"),
    ("Poland", "Warsaw"),
    ("Chile", "Santiago"),
    ("Portugal", "Lisbon"),
]
ENTITY_TEMPLATES = [
    "What is the capital of {}?",
    "What is the population of {}?",
    "What currency is used in {}?",
    "What language do people speak in {}?",
    "Do I need a visa to visit {}?",
    "What is the best time of year to travel to {}?",
]
CITIES = ["London", "Paris", "Berlin", "Madrid", "Boston", "Chicago", "Seattle", "Denver", "Sydney", "Toronto"]
CITY_TEMPLATES = [
    "What's the weather forecast for {} tomorrow?",
    "How do I get from the airport to downtown {}?",
    "Find me a cheap hotel in {}.",
    "What time is it in {} right now?",
]
PRODUCTS = [
    ("Python", "Java"),
    ("iPhone", "Android"),
    ("Excel", "Google Sheets"),
    ("PostgreSQL", "MySQL"),
    ("Windows", "Linux"),
    ("React", "Vue"),
    ("AWS", "Azure"),
    ("Chrome", "Firefox"),
]
PRODUCT_TEMPLATES = ["How do I install {} on my laptop?", "What is the latest version of {}?", "How do I uninstall {}?"]
PEOPLE = ["Alice", "Bob", "Carol", "David", "Emma", "Frank", "Grace", "Henry", "Olivia", "Liam"]
PERSON_TEMPLATES = [
    "What is {}'s phone number?",
    "Send the quarterly report to {}.",
    "When is {}'s birthday?",
    "Show me the emails from {} last week.",
    "What is {}'s account balance?",
    "Schedule a meeting with {} on Monday.",
]
FAMOUS = [
    ("Who wrote Hamlet?", "Who wrote Don Quixote?"),
    ("When was Einstein born?", "When was Newton born?"),
    ("Who painted the Mona Lisa?", "Who painted The Starry Night?"),
    ("What did Marie Curie discover?", "What did Isaac Newton discover?"),
]
NUMBER_TEMPLATES = [
    "What is {} times 7?",
    "Book a table for {} people tonight.",
    "What is the square root of {}?",
    "Set a timer for {} minutes.",
    "What happened in the year {}?",
    "Is {} a prime number?",
    "Order {} boxes of printer paper.",
    "Convert {} dollars to euros.",
]
NUMBERS = [2, 3, 4, 5, 6, 8, 10, 12, 15, 20, 25, 30, 50, 64, 100, 144, 1990, 2005]
UNIT_PAIRS = [
    ("miles", "kilometers"),
    ("pounds", "kilograms"),
    ("Celsius", "Fahrenheit"),
    ("feet", "meters"),
    ("gallons", "liters"),
    ("inches", "centimeters"),
    ("ounces", "grams"),
    ("hours", "minutes"),
]
UNIT_TEMPLATES = ["How many {b} is 10 {a}?", "Convert 5 {a} to {b}.", "How do I convert {a} to {b}?"]
NEGATIONS = [
    ("Is the store open on Sunday?", "Is the store not open on Sunday?"),
    ("Which foods contain gluten?", "Which foods do not contain gluten?"),
    ("Can I take ibuprofen with alcohol?", "Why can't I take ibuprofen with alcohol?"),
    ("Does the plan include international calls?", "Does the plan not include international calls?"),
    ("Should I use a VPN on public Wi-Fi?", "Should I never use a VPN on public Wi-Fi?"),
    ("Is this medication safe during pregnancy?", "Is this medication not safe during pregnancy?"),
    ("List the countries that use the euro.", "List the countries that don't use the euro."),
    ("Why do cats purr?", "Why don't cats purr?"),
    ("Is the package delivered?", "Is the package not delivered yet?"),
    ("Do I need a passport to fly to Mexico?", "Do I not need a passport to fly to Mexico?"),
    ("Is parking available at the venue?", "Is there no parking at the venue?"),
    ("Which vegetables can dogs eat?", "Which vegetables can dogs never eat?"),
    ("Are pets allowed in the apartment?", "Are pets not allowed in the apartment?"),
    ("Is the refund taxable?", "Is the refund not taxable?"),
    ("Does this laptop support USB-C charging?", "Does this laptop not support USB-C charging?"),
    ("How do I get a visa for a trip to Japan?", "Can I travel to Japan without a visa?"),
    ("Is coffee good for your health?", "Is coffee not good for your health?"),
    ("Which programming languages have garbage collection?", "Which programming languages have no garbage collection?"),
    ("Does the hotel have a pool?", "Doesn't the hotel have a pool?"),
    ("Is it safe to drink tap water here?", "Is it unsafe to drink tap water here?"),
]
ANTONYMS = [
    ("Is the store open on Sunday?", "Is the store closed on Sunday?"),
    ("How do I enable notifications?", "How do I disable notifications?"),
    ("What should I eat before a workout?", "What should I eat after a workout?"),
    ("How do I increase the font size?", "How do I decrease the font size?"),
    ("When is the best time to buy stocks?", "When is the best time to sell stocks?"),
    ("How do I add a user to the group?", "How do I remove a user from the group?"),
    ("What is the maximum file upload size?", "What is the minimum file upload size?"),
    ("How do I import contacts?", "How do I export contacts?"),
    ("Which is the fastest car in the world?", "Which is the slowest car in the world?"),
    ("How do I turn the volume up?", "How do I turn the volume down?"),
    ("What is the highest mountain in Europe?", "What is the lowest point in Europe?"),
    (
        "Should I drink hot or cold water in the morning? I prefer hot.",
        "Should I drink hot or cold water in the morning? I prefer cold.",
    ),
    ("How do I start the service?", "How do I stop the service?"),
    ("Who won the 2018 World Cup final?", "Who lost the 2018 World Cup final?"),
    ("How to allow pop-ups in Chrome?", "How to block pop-ups in Chrome?"),
    ("What's the best movie of 2010?", "What's the worst movie of 2010?"),
    ("How do I lock the screen?", "How do I unlock the screen?"),
    ("Why is my phone battery draining fast?", "Why is my phone battery charging slowly?"),
    ("How do I zoom in on a PDF?", "How do I zoom out on a PDF?"),
    ("What are the advantages of remote work?", "What are the disadvantages of remote work?"),
    ("How do I encrypt a file?", "How do I decrypt a file?"),
    ("Which foods raise blood pressure?", "Which foods lower blood pressure?"),
]
ORDER = [
    ("Did Germany beat Brazil in 2014?", "Did Brazil beat Germany in 2014?"),
    ("How do I convert a list to a string in Python?", "How do I convert a string to a list in Python?"),
    ("How do I copy files from my phone to my laptop?", "How do I copy files from my laptop to my phone?"),
    ("Translate 'good morning' from English to Spanish.", "Translate 'good morning' from Spanish to English."),
    ("How long is the flight from London to New York?", "How long is the flight from New York to London?"),
    ("Is Alice Bob's manager?", "Is Bob Alice's manager?"),
    ("How do I move money from savings to checking?", "How do I move money from checking to savings?"),
    ("Convert JSON to YAML.", "Convert YAML to JSON."),
    ("Who is older, Tom or his sister?", "Who is younger, Tom or his sister?"),
    ("Does a dog chase a cat?", "Does a cat chase a dog?"),
    ("Send the invoice from Acme to Globex.", "Send the invoice from Globex to Acme."),
    ("How do I migrate from MySQL to PostgreSQL?", "How do I migrate from PostgreSQL to MySQL?"),
    ("Is Paris north of Madrid?", "Is Madrid north of Paris?"),
    ("What is the exchange rate from dollars to euros?", "What is the exchange rate from euros to dollars?"),
    ("Subtract 3 from 10.", "Subtract 10 from 3."),
    ("Did the cat scratch the child?", "Did the child scratch the cat?"),
]
UNRELATED_POOL = [s for s, _ in PARAPHRASES] + [
    "Set an alarm for tomorrow morning.",
    "Tell me a joke about programmers.",
    "What is the stock price of ACME?",
    "Recommend a good science fiction novel.",
    "How do I knit a scarf?",
    "Play some relaxing music.",
]


def build(rng: random.Random) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []

    def add(query: str, stored: str, label: str, kind: str) -> None:
        rows.append({"query": query, "stored": stored, "label": label, "kind": kind})

    for stored, query in PARAPHRASES:
        add(query, stored, "paraphrase", "paraphrase")
    for template in ENTITY_TEMPLATES:  # another country, same question
        for _ in range(4):
            (a, _), (b, _) = rng.sample(CAPITALS, 2)
            add(template.format(b), template.format(a), "near_miss", "entity")
    for template in CITY_TEMPLATES:
        for _ in range(3):
            a, b = rng.sample(CITIES, 2)
            add(template.format(b), template.format(a), "near_miss", "entity")
    for template in PRODUCT_TEMPLATES:
        for a, b in rng.sample(PRODUCTS, 3):
            add(template.format(b), template.format(a), "near_miss", "entity")
    for template in PERSON_TEMPLATES:
        for _ in range(4):
            a, b = rng.sample(PEOPLE, 2)
            add(template.format(b), template.format(a), "near_miss", "person")
    for stored, query in FAMOUS:
        add(query, stored, "near_miss", "person")
    for template in NUMBER_TEMPLATES:
        for _ in range(4):
            a, b = rng.sample(NUMBERS, 2)
            add(template.format(b), template.format(a), "near_miss", "number")
    for template in UNIT_TEMPLATES:
        for a, b in UNIT_PAIRS:  # the conversion asked the other way round: a swapped unit
            add(template.format(a=b, b=a), template.format(a=a, b=b), "near_miss", "unit")
    for stored, query in NEGATIONS:
        add(query, stored, "near_miss", "negation")
    for stored, query in ANTONYMS:
        add(query, stored, "near_miss", "antonym")
    for stored, query in ORDER:
        add(query, stored, "near_miss", "order")
    queries = [q for _, q in PARAPHRASES]
    for _ in range(60):  # a query, and a stored text on another topic
        query = queries[rng.randrange(len(queries))]
        stored = rng.choice([s for s in UNRELATED_POOL if s not in dict(PARAPHRASES) or dict(PARAPHRASES)[s] != query])
        add(query, stored, "unrelated", "unrelated")
    return rows


def main() -> None:
    write_pairs(build(random.Random(SEED)), OUT)


if __name__ == "__main__":
    main()
