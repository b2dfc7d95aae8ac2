"""Generate ``semantic_blind.jsonl``: a blind test set for the semantic LLM-response cache.

Each line of the output is one JSON object::

    {"query": str, "stored": str, "label": str, "kind": str}

``stored`` is a question the cache already holds an answer for; ``query`` is what a user types.
``label`` says whether the stored answer may be returned for the query:

* ``"paraphrase"`` (kind ``"paraphrase"``): the same question in other words (reordering, synonyms,
  casual/formal register, politeness, lower-case typing, small typos, "Tell me ..."/"Explain ..."
  forms, common abbreviations). The cache must hit.
* ``"near_miss"``: looks alike, high word overlap, but asks something else. The cache must NOT hit.
  ``kind`` names the critical detail that changed: ``"entity"`` (country, city, product, company,
  language, food, animal), ``"person"`` (another person, incl. titles such as Dr./Mr.), ``"number"``
  (another number, digits or words, incl. hyphenated ages), ``"unit"`` (another unit or a reversed
  conversion), ``"negation"`` (not/never/don't/without/no), ``"antonym"`` (warmest/coldest,
  cheapest/priciest, arrive/leave, ...), ``"order"`` (swapped arguments of a relation).
* ``"unrelated"`` (kind ``"unrelated"``): a different topic entirely, some sharing surface words.

This is a BLIND test set: the pairs were hand-written without looking at the rule-based verifier
being tuned or at the other evaluation sets, so it measures generalization honestly. Tune on the
other sets, then run this one once, after tuning is finished; do not tune against it.

How it was actually used (issue 4): run once with the verifier tuned on the other two sets, at the
default threshold 0.70: recall 88.5 %, false hits 7.8 % (12 of 154; 11 of them pairs equal but for one
swapped word: cats/dogs, leave/arrive, third/second, ...). The *substitution* rule of
``kvmem/semantic/verify.py`` was then added because of what it showed (recall 76.9 %, false hits 0.6 %
after). So it is no longer blind: a new blind set is needed for the next honest measurement.

Regenerate (deterministic, fixed seed) with::

    python benchmarks/data/make_semantic_blind.py
"""

from __future__ import annotations

import random
from pathlib import Path

from pairs_io import write_pairs

SEED: int = 20240917
OUT_PATH: Path = Path(__file__).resolve().parent / "semantic_blind.jsonl"

Pair = tuple[str, str]  # (stored, query)

# ---------------------------------------------------------------------------------------------
# Paraphrases: same question, other words. Must hit.
# ---------------------------------------------------------------------------------------------
PARAPHRASES: list[Pair] = [
    # real estate
    (
        "How much should I budget for closing costs when buying a house?",
        "what do closing costs usually run when you buy a home",
    ),
    (
        "What is the difference between a fixed-rate and an adjustable-rate mortgage?",
        "Explain fixed vs adjustable rate mortgages",
    ),
    (
        "Can my landlord raise the rent in the middle of a lease?",
        "is it legal for a landlord to increase rent mid lease?",
    ),
    ("How do I calculate the square footage of a room?", "how to figure out a room's square footage"),
    ("What does escrow mean in a home purchase?", "Could you please tell me what escrow is when buying a house?"),
    # automotive
    ("How often should I rotate my car's tires?", "how frequently do i need to get my tires rotated"),
    ("What does the check engine light mean?", "What is the check engine light telling me?"),
    ("How do I jump-start a car with a dead battery?", "Tell me how to jump start a car whose battery died"),
    ("What tire pressure should I use for my car?", "wat psi should my car tires be at"),
    ("How long does a car battery typically last?", "whats the usual lifespan of a car battery"),
    # gardening
    ("When should I plant tomatoes outdoors?", "what's the right time to put tomato plants outside"),
    ("How often should I water succulents?", "how frequently do succulents need watering?"),
    ("How do I get rid of aphids on my roses?", "Best way to eliminate aphids from rose bushes?"),
    ("What is the best way to start a compost pile?", "how do i begin composting at home"),
    ("Why are the leaves on my tomato plant turning yellow?", "tomato plant leaves going yellow, what's causing it?"),
    # education
    ("How do I calculate my GPA?", "Can you explain how to work out my grade point average?"),
    (
        "What is the difference between a bachelor's and a master's degree?",
        "bachelors vs masters degree, whats the difference",
    ),
    ("How can I improve my child's reading comprehension?", "Tips to help my kid understand what they read better?"),
    ("When is the deadline to file the FAFSA?", "whats the FAFSA filing deadline"),
    ("How do I write a strong college application essay?", "Give me advice on writing a good college admissions essay"),
    # legal
    ("How do I file a small claims lawsuit?", "what's the process for suing someone in small claims court"),
    ("What is the difference between a will and a living trust?", "Explain will vs living trust"),
    ("Do I need a lawyer to get a divorce?", "is it necessary to hire an attorney for a divorce?"),
    ("How long does a copyright last?", "what is the duration of copyright protection"),
    ("What should I do after a minor car accident?", "Steps to take after a small fender bender?"),
    # pets
    ("How often should I feed my puppy?", "how many times a day should a puppy eat"),
    ("Is chocolate toxic to dogs?", "can chocolate poison a dog?"),
    ("How do I litter train a kitten?", "whats the best way to teach a kitten to use the litter box"),
    ("Why does my cat knead blankets?", "What's the reason cats knead on blankets?"),
    ("How do I trim my dog's nails safely?", "Tell me how to safely clip my dog's nails"),
    # music
    ("How do I tune a guitar without a tuner?", "ways to tune a guitar by ear with no tuner"),
    ("What is the difference between a major and a minor scale?", "major vs minor scale difference?"),
    ("How long does it take to learn piano?", "how much time does it usually take to learn the piano"),
    ("Who composed the Four Seasons?", "who wrote the four seasons concertos"),
    ("What are the chords in a 12-bar blues?", "which chords make up a twelve bar blues progression"),
    # gaming
    ("How do I increase FPS in PC games?", "how can i boost my frame rate when gaming on pc"),
    ("What is the best way to farm gold in World of Warcraft?", "most efficient way to make gold in WoW?"),
    ("Is the Nintendo Switch backwards compatible with Wii U games?", "can the switch play wii u games"),
    ("How do I stream my gameplay on Twitch?", "Explain how to stream games to Twitch"),
    ("What does DLC stand for in video games?", "what's DLC mean in gaming"),
    # telecom
    ("How do I unlock my phone to use another carrier?", "how to carrier unlock my phone so i can switch networks"),
    ("What is the difference between 4G and 5G?", "4G vs 5G, what's the difference?"),
    ("Why is my Wi-Fi so slow?", "what could be making my wifi really slow"),
    (
        "How do I port my number to a new carrier?",
        "can you tell me how to transfer my phone number to a different provider",
    ),
    ("What does eSIM mean?", "what is an esim"),
    # insurance
    ("What is a deductible in health insurance?", "Explain what a health insurance deductible is"),
    ("Does homeowners insurance cover flood damage?", "is flood damage covered by home owners insurance"),
    ("How can I lower my car insurance premium?", "ways to reduce what I pay for auto insurance"),
    ("What is the difference between term and whole life insurance?", "term life vs whole life insurance?"),
    ("Do I need renters insurance?", "is renter's insurance something i actually need"),
    # energy
    ("How do solar panels work?", "Explain how solar panels produce electricity"),
    ("How can I lower my electricity bill in summer?", "tips for cutting my power bill during the summer"),
    ("What is a kilowatt-hour?", "what does kWh mean"),
    ("Are heat pumps efficient in cold climates?", "do heat pumps work well where it's really cold"),
    ("How much does it cost to install solar panels?", "whats the price of getting solar panels put in"),
    # public transport
    (
        "How do I get from JFK Airport to Manhattan by public transit?",
        "best way to get to manhattan from jfk using public transport",
    ),
    ("Can I bring my bike on the subway?", "are bikes allowed on the subway?"),
    ("How much is a monthly bus pass in Chicago?", "what does a monthly bus pass cost in chicago"),
    ("What time does the last train leave Penn Station?", "When's the final train out of Penn Station?"),
    ("Do I need to validate my train ticket in Italy?", "do you have to stamp train tickets in italy"),
    # parenting
    ("How much sleep does a toddler need?", "how many hours of sleep should a toddler get"),
    ("How do I get my baby to sleep through the night?", "tips to help my baby sleep thru the night"),
    ("When do babies start teething?", "at what age does teething usually begin in babies"),
    ("How do I handle toddler tantrums?", "what's the best way to deal with a toddler's temper tantrums"),
    ("When can a child sit in the front seat of a car?", "what age can kids ride in the front seat"),
    # fitness
    ("How many calories does running a mile burn?", "how many cals do you burn running one mile"),
    ("What is the best way to build muscle?", "Tell me the most effective way to gain muscle"),
    ("How often should I do strength training?", "how many times a week should i do strength workouts"),
    ("Is it better to stretch before or after a workout?", "should i stretch before working out or after?"),
    ("How much protein do I need per day?", "whats my daily protein requirement"),
    # weather
    ("What causes thunderstorms?", "why do thunderstorms happen"),
    ("What is the difference between a hurricane and a typhoon?", "hurricane vs typhoon, how are they different"),
    ("How is the heat index calculated?", "could you explain how they compute the heat index"),
    # literature
    ("Who wrote Pride and Prejudice?", "who is the author of pride and prejudice"),
    ("What is the main theme of To Kill a Mockingbird?", "whats the central theme of to kill a mockingbird"),
    ("What is the difference between a simile and a metaphor?", "simile vs metaphor, explain the difference please"),
    ("How many books are in the Harry Potter series?", "how many harry potter books are there"),
    ("When was 1984 by George Orwell published?", "what year did orwell publish nineteen eighty-four"),
]

# ---------------------------------------------------------------------------------------------
# Near misses: high overlap, one critical detail changed. Must NOT hit.
# ---------------------------------------------------------------------------------------------
NEAR_MISS_ENTITY: list[Pair] = [
    ("What is the average home price in Denver?", "What is the average home price in Dallas?"),
    ("How often should I change the oil in a Toyota Camry?", "How often should I change the oil in a Honda Accord?"),
    ("When should I plant garlic in the fall?", "When should I plant tulips in the fall?"),
    ("Is chocolate toxic to dogs?", "is chocolate toxic to cats?"),
    ("Can rabbits eat carrots?", "can guinea pigs eat carrots?"),
    ("How do I learn to play the violin?", "How do I learn to play the cello?"),
    ("What are the best settings for Fortnite on PS5?", "What are the best settings for Fortnite on Xbox Series X?"),
    ("Does Verizon offer unlimited data plans?", "does t-mobile offer unlimited data plans?"),
    ("Does State Farm cover rental cars?", "Does Geico cover rental cars?"),
    ("How much does electricity cost per kWh in California?", "How much does electricity cost per kWh in texas?"),
    ("How do I get from the airport to downtown in Boston?", "how do i get from the airport to downtown in seattle?"),
    ("What is the average rainfall in London in April?", "What is the average rainfall in Paris in April?"),
    ("Is Spanish hard to learn for English speakers?", "is mandarin hard to learn for english speakers?"),
    (
        "What is the statute of limitations for breach of contract in New York?",
        "What is the statute of limitations for breach of contract in Florida?",
    ),
    ("How many calories are in an avocado?", "how many calories are in a banana?"),
    ("Who wrote the novel Dracula?", "Who wrote the novel Frankenstein?"),
    ("What is the annual tuition at Harvard?", "what is the annual tuition at stanford?"),
]

NEAR_MISS_PERSON: list[Pair] = [
    ("What novels did Jane Austen write?", "What novels did Charlotte Brontë write?"),
    ("When was Ernest Hemingway born?", "When was F. Scott Fitzgerald born?"),
    ("What instruments did Wolfgang Amadeus Mozart play?", "What instruments did Ludwig van Beethoven play?"),
    ("How tall is LeBron James?", "How tall is Kevin Durant?"),
    ("Is Dr. Sarah Lee accepting new pediatric patients?", "Is Dr. Sarah Kim accepting new pediatric patients?"),
    ("When are Mr. Johnson's office hours this semester?", "When are Mrs. Johnson's office hours this semester?"),
    ("What homes has realtor Karen Brooks sold this year?", "What homes has realtor Karen Woods sold this year?"),
    ("What notable cases has Judge Robert Hayes ruled on?", "What notable cases has Judge Robert Haynes ruled on?"),
    ("What games has Hideo Kojima directed?", "What games has Shigeru Miyamoto directed?"),
    ("What is Billie Eilish's most streamed song?", "What is Olivia Rodrigo's most streamed song?"),
    ("Which car companies did Elon Musk help found?", "Which car companies did Henry Ford help found?"),
    ("What was Arnold Schwarzenegger's workout routine?", "What was Dwayne Johnson's workout routine?"),
    ("What is Stephen King's best-selling book?", "What is Dean Koontz's best-selling book?"),
    ("What does Dr. Benjamin Spock recommend for teething?", "What does Dr. Harvey Karp recommend for teething?"),
    (
        "What did Nikola Tesla contribute to alternating current?",
        "What did George Westinghouse contribute to alternating current?",
    ),
    ("What inventions is Alexander Graham Bell known for?", "What inventions is Guglielmo Marconi known for?"),
    ("How do I contact my insurance agent, Ms. Laura Diaz?", "How do I contact my insurance agent, Ms. Laura Ortiz?"),
    (
        "What dog training methods does Cesar Millan recommend?",
        "What dog training methods does Victoria Stilwell recommend?",
    ),
]

NEAR_MISS_NUMBER: list[Pair] = [
    ("How many calories does a 30-minute run burn?", "How many calories does a 60-minute run burn?"),
    (
        "What is the monthly payment on a $300,000 mortgage at 6% interest?",
        "What is the monthly payment on a $400,000 mortgage at 6% interest?",
    ),
    ("How many hours should a six-year-old sleep?", "How many hours should a nine-year-old sleep?"),
    ("Can a 4-year-old ride in a booster seat?", "Can a 2-year-old ride in a booster seat?"),
    ("How often should I feed a 3-month-old kitten?", "How often should I feed a 6-month-old kitten?"),
    ("How much does a 10 kW solar system cost?", "How much does a 5 kW solar system cost?"),
    ("Is 16 GB of RAM enough for gaming?", "Is 8 GB of RAM enough for gaming?"),
    (
        "What's the fine for driving 15 mph over the speed limit?",
        "what's the fine for driving 25 mph over the speed limit?",
    ),
    (
        "How much does a 3 bedroom apartment rent for in Austin?",
        "how much does a two bedroom apartment rent for in Austin?",
    ),
    ("What is the weather forecast for the next 3 days?", "What is the weather forecast for the next ten days?"),
    ("How many plants fit in a 4x8 raised bed?", "How many plants fit in a 4x4 raised bed?"),
    ("What were the best-selling songs of the 1980s?", "What were the best-selling songs of the 1990s?"),
    ("Summarize chapter 3 of The Great Gatsby.", "Summarize chapter 5 of The Great Gatsby."),
    (
        "How much does it cost to add a second line to my phone plan?",
        "How much does it cost to add a third line to my phone plan?",
    ),
    (
        "How much does term life insurance cost for a 30-year-old?",
        "how much does term life insurance cost for a fifty-year-old?",
    ),
    ("What topics are covered in 7th grade math?", "What topics are covered in 8th grade math?"),
    ("When does bus 42 stop running at night?", "When does bus 24 stop running at night?"),
    ("What are my rights under the 5th Amendment?", "What are my rights under the 4th Amendment?"),
    ("What are good exercises for someone over 40?", "What are good exercises for someone over sixty?"),
]

NEAR_MISS_UNIT: list[Pair] = [
    ("How many miles is 10 kilometers?", "How many kilometers is 10 miles?"),
    ("What is 30 degrees Celsius in Fahrenheit?", "What is 30 degrees Fahrenheit in Celsius?"),
    ("How many square feet are in 50 square meters?", "How many square meters are in 50 square feet?"),
    ("Convert 60 mph to km/h.", "convert 60 km/h to mph"),
    ("How many gallons of water does a lawn need per week?", "How many inches of water does a lawn need per week?"),
    ("How much does a 20 kg bag of dog food cost?", "How much does a 20 lb bag of dog food cost?"),
    (
        "What is the average price of electricity per kilowatt-hour?",
        "What is the average price of electricity per megawatt-hour?",
    ),
    ("How much does gas cost per gallon in Canada?", "How much does gas cost per liter in Canada?"),
    ("How many calories are burned per hour of cycling?", "how many calories are burned per mile of cycling?"),
    (
        "How long does it take to download 5 GB on a 100 Mbps connection?",
        "How long does it take to download 5 TB on a 100 Mbps connection?",
    ),
    ("What's 25 mm of rain in inches?", "What's 25 inches of rain in mm?"),
    ("How many pounds is a 100 kg bench press?", "How many kilograms is a 100 lb bench press?"),
    (
        "How many hours of practice per week do I need to learn guitar?",
        "How many hours of practice per day do I need to learn guitar?",
    ),
    (
        "How many ounces of formula should a newborn drink per feeding?",
        "How many ounces of formula should a newborn drink per day?",
    ),
    (
        "How much is the monthly premium for basic renters insurance?",
        "How much is the annual premium for basic renters insurance?",
    ),
    ("What is the price per square foot for land in Phoenix?", "What is the price per acre for land in Phoenix?"),
]

NEAR_MISS_NEGATION: list[Pair] = [
    ("What foods are safe for dogs to eat?", "What foods are not safe for dogs to eat?"),
    ("Which plants grow well in shade?", "Which plants don't grow well in shade?"),
    ("What does homeowners insurance cover?", "What does homeowners insurance not cover?"),
    ("Can I break my lease if my landlord makes repairs?", "Can I break my lease if my landlord never makes repairs?"),
    ("How do I grow tomatoes with fertilizer?", "How do I grow tomatoes without fertilizer?"),
    ("Can I drive my car with insurance in another state?", "Can I drive my car without insurance in another state?"),
    ("What happens if I pass the final exam?", "What happens if I don't pass the final exam?"),
    ("What happens to my property if I die with a will?", "What happens to my property if I die without a will?"),
    ("Which dog breeds shed a lot?", "Which dog breeds don't shed?"),
    ("Recommend some music with lyrics for studying.", "recommend some music without lyrics for studying"),
    (
        "Which games support cross-play between PlayStation and PC?",
        "Which games don't support cross-play between PlayStation and PC?",
    ),
    ("Which phone plans include international roaming?", "Which phone plans don't include international roaming?"),
    (
        "Can I get a tax credit for solar panels if I own my home?",
        "Can I get a tax credit for solar panels if I don't own my home?",
    ),
    ("Which subway stations have elevators?", "Which subway stations have no elevators?"),
    ("Is it normal for a 2-year-old to talk in sentences?", "Is it normal for a 2-year-old not to talk in sentences?"),
    ("Can I lose weight by running?", "Can I lose weight without running?"),
    (
        "Where should I shelter during a tornado if I have a basement?",
        "Where should I shelter during a tornado if I don't have a basement?",
    ),
    ("Which Shakespeare plays are comedies?", "Which Shakespeare plays are not comedies?"),
    ("Can I buy a house with a down payment?", "Can I buy a house with no down payment?"),
]

NEAR_MISS_ANTONYM: list[Pair] = [
    ("What is the warmest month in Chicago?", "What is the coldest month in Chicago?"),
    ("What is the cheapest electric car?", "What is the priciest electric car?"),
    ("How do I sort my playlist in ascending order?", "How do I sort my playlist in descending order?"),
    ("What time does the train from Boston arrive?", "What time does the train from Boston leave?"),
    ("How do I reduce noise from my upstairs neighbors?", "How do I reduce noise from my downstairs neighbors?"),
    ("What are the benefits of buying a home?", "What are the benefits of renting a home?"),
    ("How do I raise the pH of my garden soil?", "How do I lower the pH of my garden soil?"),
    ("What are the advantages of homeschooling?", "What are the disadvantages of homeschooling?"),
    ("What is the easiest boss in Elden Ring?", "What is the hardest boss in Elden Ring?"),
    ("How do I increase my upload speed?", "How do I increase my download speed?"),
    (
        "What is the maximum payout on a life insurance policy?",
        "What is the minimum payout on a life insurance policy?",
    ),
    ("What are the largest cat breeds?", "What are the smallest cat breeds?"),
    ("How do I gain weight fast?", "How do I lose weight fast?"),
    ("How do I tune my guitar up a half step?", "How do I tune my guitar down a half step?"),
    ("What is the minimum sentence for burglary?", "What is the maximum sentence for burglary?"),
    ("What are the signs my baby is overfed?", "What are the signs my baby is underfed?"),
    ("Who is the protagonist in Hamlet?", "Who is the antagonist in Hamlet?"),
    ("When are electricity rates highest during the day?", "When are electricity rates lowest during the day?"),
    ("What does a high oil pressure reading mean?", "What does a low oil pressure reading mean?"),
    ("When is the subway least crowded?", "When is the subway most crowded?"),
]

NEAR_MISS_ORDER: list[Pair] = [
    ("Is a Labrador bigger than a Golden Retriever?", "Is a Golden Retriever bigger than a Labrador?"),
    (
        "What time is the first bus from the airport to downtown?",
        "What time is the first bus from downtown to the airport?",
    ),
    ("My landlord owes me money for repairs, what can I do?", "I owe my landlord money for repairs, what can I do?"),
    ("How do I convert a PDF to a Word document?", "How do I convert a Word document to a PDF?"),
    ("How do I transfer my contacts from Android to iPhone?", "How do I transfer my contacts from iPhone to Android?"),
    ("Is Stephen King older than John Grisham?", "Is John Grisham older than Stephen King?"),
    ("Is a Tesla Model 3 faster than a BMW M3?", "Is a BMW M3 faster than a Tesla Model 3?"),
    ("Can my employer sue me for quitting?", "Can I sue my employer for quitting?"),
    ("Can I transfer my save files from PS4 to PS5?", "Can I transfer my save files from PS5 to PS4?"),
    ("Do tomatoes need more water than peppers?", "Do peppers need more water than tomatoes?"),
    (
        "Does my car insurance cover me when I drive my friend's car?",
        "Does my car insurance cover my friend when he drives my car?",
    ),
    ("Is solar power cheaper than wind power?", "Is wind power cheaper than solar power?"),
    ("Does my ex have to pay me child support?", "Do I have to pay my ex child support?"),
    ("Does running burn more calories than swimming?", "Does swimming burn more calories than running?"),
    ("How do I transpose a song from C major to G major?", "How do I transpose a song from G major to C major?"),
    ("Is Seattle rainier than Portland?", "Is Portland rainier than Seattle?"),
    ("Can dogs catch colds from humans?", "Can humans catch colds from dogs?"),
    (
        "How do I transfer the house deed from my parents to me?",
        "How do I transfer the house deed from me to my parents?",
    ),
    (
        "Can I transfer credits from a community college to a university?",
        "Can I transfer credits from a university to a community college?",
    ),
]

NEAR_MISSES: dict[str, list[Pair]] = {
    "entity": NEAR_MISS_ENTITY,
    "person": NEAR_MISS_PERSON,
    "number": NEAR_MISS_NUMBER,
    "unit": NEAR_MISS_UNIT,
    "negation": NEAR_MISS_NEGATION,
    "antonym": NEAR_MISS_ANTONYM,
    "order": NEAR_MISS_ORDER,
}

# ---------------------------------------------------------------------------------------------
# Unrelated: a different topic entirely (some share surface words). Must NOT hit.
# ---------------------------------------------------------------------------------------------
UNRELATED: list[Pair] = [
    ("How do I change a flat tire?", "What's a good recipe for banana bread?"),
    ("What is the best fertilizer for roses?", "How do I reset my router password?"),
    ("How much is a monthly bus pass in Chicago?", "How much does a Chicago Bulls ticket cost?"),
    ("How do I train my dog to sit?", "How do I train for a marathon?"),
    ("What does a home inspection include?", "What does a Netflix subscription include?"),
    ("Who wrote The Old Man and the Sea?", "What's the weather like by the sea in June?"),
    ("How do I file an insurance claim?", "How do I file my taxes online?"),
    ("What is the best guitar for beginners?", "What is the best credit card for beginners?"),
    ("How do I lower my electricity bill?", "How do I lower my cholesterol?"),
    ("When does the school year start in Texas?", "When does hurricane season start in Texas?"),
    ("Can I bring my cat on a plane?", "Can I bring a calculator to the SAT?"),
    ("What is the best chess opening for beginners?", "How often should I water a cactus?"),
    ("How do I cancel my phone contract?", "How do I cancel my gym membership?"),
    ("What are the symptoms of heat stroke?", "What are the symptoms of a failing alternator?"),
    ("How do I get custody of my kids?", "How do I get rid of moles in my yard?"),
    ("What's a good workout for abs?", "What's a good name for a golden retriever puppy?"),
    ("How long does a mortgage pre-approval take?", "How long does it take to hard boil an egg?"),
    ("What are the rules of Monopoly?", "What are the rules for carry-on luggage?"),
    ("Is it going to snow this weekend?", "Is it worth buying an extended car warranty?"),
    ("Who sang Bohemian Rhapsody?", "How do I set up a 401k?"),
    ("How do I charge an electric car at home?", "How do I charge my AirPods case?"),
    ("What is the plot of Moby-Dick?", "How big a plot do I need for a vegetable garden?"),
    ("How do I unclog a bathroom drain?", "What are the best co-op games on Switch?"),
    ("How do I switch to a cheaper energy supplier?", "How do I switch my Nintendo account region?"),
    ("What should I pack for a toddler on a long flight?", "What should I pack for a week of hiking in Patagonia?"),
    ("When is the next full moon?", "When is the next train to Philadelphia?"),
]

MIN_PER_NEAR_MISS_KIND: int = 13


def build_rows() -> list[dict[str, str]]:
    """Return all labelled pairs, shuffled deterministically with ``SEED``."""
    rows: list[dict[str, str]] = []
    for stored, query in PARAPHRASES:
        rows.append({"query": query, "stored": stored, "label": "paraphrase", "kind": "paraphrase"})
    for kind, pairs in NEAR_MISSES.items():
        if len(pairs) < MIN_PER_NEAR_MISS_KIND:
            raise ValueError(f"near_miss kind {kind!r} has only {len(pairs)} pairs")
        for stored, query in pairs:
            rows.append({"query": query, "stored": stored, "label": "near_miss", "kind": kind})
    for stored, query in UNRELATED:
        rows.append({"query": query, "stored": stored, "label": "unrelated", "kind": "unrelated"})

    seen: set[tuple[str, str]] = set()
    for row in rows:
        key = (row["stored"], row["query"])
        if key in seen:
            raise ValueError(f"duplicate pair: {key!r}")
        if row["stored"] == row["query"]:
            raise ValueError(f"query identical to stored: {row['query']!r}")
        seen.add(key)

    random.Random(SEED).shuffle(rows)
    return rows


def main() -> None:
    write_pairs(build_rows(), OUT_PATH)


if __name__ == "__main__":
    main()
